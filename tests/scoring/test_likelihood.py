"""Batched log-likelihoods (zaya_jax.scoring.likelihood): many requests packed to a forward pass
score what one unpadded forward per request scores, shared inputs are read once, and rows are
split over devices without changing a score."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.random_model import varied_variables
from tests.scoring.requests import CFG, random_requests
from zaya_jax.model import Zaya
from zaya_jax.scoring.likelihood import Batch, LikelihoodScorer, Shared, batches, model_inputs, plan


def _one_row_each(variables, requests, max_length: int) -> list[tuple[float, bool]]:
    """(log p(continuation | context), greedy) with every request in a row of its own, at its
    start (causal: the padding after it changes nothing), in float64 from one forward."""
    inputs = [[*c, *t][-(max_length + 1) :] for c, t in requests]
    tokens = np.zeros((len(inputs), max_length), np.int32)
    for row, ids in enumerate(inputs):
        tokens[row, : len(ids) - 1] = ids[:-1]
    logits, _ = jax.jit(Zaya(CFG).apply)(variables, tokens, token_mask=tokens > -1)
    out = []
    for row, (ids, (_, continuation)) in enumerate(zip(inputs, requests, strict=True)):
        n, k = len(ids) - 1, len(continuation)
        rows = np.asarray(logits[row, n - k : n], np.float64)
        logprobs = rows - rows.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        targets = ids[-k:]
        out.append((float(logprobs[np.arange(k), targets].sum()), bool((rows.argmax(-1) == targets).all())))
    return out


def test_packed_scores_equal_one_forward_per_request():
    variables = varied_variables(CFG)
    requests = random_requests()
    scorer = LikelihoodScorer(CFG, variables, batch_tokens=128)
    got = scorer.score(requests, max_length=32)  # some requests longer: left-truncated as lm-eval does
    passes = list(plan(requests, 32, 128))
    assert {type(p) for p in passes} == {Batch, Shared} and len(passes) > 2  # packed and shared passes
    for (score, greedy), result in zip(_one_row_each(variables, requests, 32), got, strict=True):
        assert result.logprob == pytest.approx(score, abs=1e-5)
        assert result.greedy == greedy


def test_shared_inputs_and_prefixes_are_read_once_and_short_inputs_fill_rows():
    requests = random_requests()
    inputs = model_inputs(requests, 32)
    distinct = {tuple([*c, *t][-33:-1]) for c, t in requests}
    assert len(inputs) == len(distinct) < len(requests)  # one-token answers of a context: one input

    context, answers = list(range(3, 40)), [[5, 6], [7], [8, 9, 10]]
    (shared,) = plan([(context, a) for a in answers], 64, 4096)  # a question's answers: one pass
    assert isinstance(shared, Shared) and shared.prefix_n[0] == len(context) - 1  # the prefix read once
    assert sorted(shared.suffix_n[:3].tolist()) == [1, 2, 3] and shared.parent[:3].tolist() == [0, 0, 0]

    lengths = [33, 30, 5, 4, 2]
    packed = list(batches([(tuple(range(3, 3 + n)), [(i, (1,))]) for i, n in enumerate(lengths)], 4096))
    documents = sum(int(b.segment_ids.max(axis=1).sum()) for b in packed)
    rows = sum(int((b.segment_ids.max(axis=1) > 0).sum()) for b in packed)
    assert documents == len(lengths) and rows < documents  # the short ones fill the long ones' rows
    assert sorted(i for b in packed for i, _, _ in b.owners) == list(range(len(lengths)))


def test_bad_requests_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match=r"request 1 has an empty context.*prefix token"):
        model_inputs([([3], [4]), ([], [4])], 32)
    with pytest.raises(ValueError, match=r"request 0's continuation has 5 tokens.*raise max_length"):
        model_inputs([([3], [4] * 5)], 4)


def test_rows_split_over_eight_devices_score_the_same():
    """The scorer on 8 (fake CPU) devices, in a subprocess, gives the scores of one device."""
    code = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import jax
from tests.scoring.requests import CFG, random_requests
from tests.random_model import varied_variables
from zaya_jax.scoring.likelihood import LikelihoodScorer
assert jax.local_device_count() == 8
got = LikelihoodScorer(CFG, varied_variables(CFG)).score(random_requests(n=16), 32)
print(json.dumps([[r.logprob, r.greedy] for r in got]))
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    split = json.loads(done.stdout.strip().splitlines()[-1])
    one = LikelihoodScorer(CFG, varied_variables(CFG), devices=jax.devices()[:1])
    requests = random_requests(n=16)
    assert {type(p) for p in plan(requests, 32, one.batch_tokens)} == {Batch, Shared}  # both programs
    for (logprob, greedy), result in zip(split, one.score(requests, 32), strict=True):
        assert logprob == pytest.approx(result.logprob, abs=1e-5) and greedy == result.greedy


def test_a_capacity_model_is_scored_without_dropping_tokens():
    cfg = dataclasses.replace(CFG, moe_impl="capacity", capacity_factor=0.5)
    assert LikelihoodScorer(cfg, varied_variables(CFG)).cfg.moe_impl == "sorted"
