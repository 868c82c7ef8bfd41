"""Rollouts from another engine (``rl.rollouts``): vLLM's route layout (``routed_experts`` with a
``routed_skip`` mask) becomes zaya's classes and replays exactly; without the mask it is refused,
since vLLM rewrites a skip choice to expert 0; and a batch whose recorded log-probabilities the
trainer does not reproduce (``rl.max_sampler_gap``) stops the run or is skipped
(``resilience.on_metric_bound``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.fixtures import GRPO, MINI
from zaya_jax import checkpoint
from zaya_jax.cli import main
from zaya_jax.config import load_config
from zaya_jax.data import DataError, load_tokenizer
from zaya_jax.generate import generate
from zaya_jax.model import init_variables
from zaya_jax.objectives.rollout_files import read_rollout_files

RECORD = {"group": 0, "prompt_ids": [5, 6], "completion_ids": [7, 2], "logprobs": [-0.5, -0.1], "reward": 1.0}
EXPERTS = [[[0], [1]], [[0], [0]], [[1], [-1]]]  # 3 tokens read x 2 layers x top_k 1 (MINI: E = 2)
SKIP = [[True, False], [False, False], [False, True]]


def _read(tmp_path, **fields):
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps({**RECORD, **fields}) + "\n")
    cfg = load_config("tiny", [*MINI, "model.vocab_size=512", "train.objective=grpo", f"rl.rollouts={path}"])
    return read_rollout_files(cfg)


def test_vllm_routes_with_the_skip_mask_become_zaya_classes(tmp_path):
    (completion,) = _read(tmp_path, routed_experts=EXPERTS, routed_skip=SKIP)
    # the masked (token, layer) pairs are the skip class E = 2; -1 (not recorded) stays unknown
    np.testing.assert_array_equal(completion.routes, [[2, 1], [0, 0], [1, 2]])
    as_ints = _read(tmp_path, routed_experts=EXPERTS, routed_skip=np.asarray(SKIP, int).tolist())[0]
    np.testing.assert_array_equal(as_ints.routes, completion.routes)
    zaya = _read(tmp_path, routes=[[2, 1], [0, 0], [1, 2]])[0]  # zaya's own layout, the same classes
    np.testing.assert_array_equal(zaya.routes, completion.routes)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {"routed_experts": EXPERTS},
            r"routed_experts without routed_skip: this model's router has a skip class besides its 2 "
            r"experts, and vLLM rewrites a skip choice to expert 0 \(with weight 0\), so these routes cannot "
            r"tell a skipped token from one routed to expert 0 .*Supply routed_skip .*or drop routed_experts",
        ),
        (
            {"routed_experts": [[[0, 1], [1, 0]]] * 3, "routed_skip": SKIP},
            r"routed_experts hold top_k=2 experts per token; .*only top_k=1 is supported",
        ),
        (
            {"routed_experts": EXPERTS[:2], "routed_skip": SKIP[:2]},
            r"routed_experts have shape \(2, 2, 1\), expected \(3, 2, 1\)",
        ),
        (
            {"routed_experts": [[[0], [2]]] * 3, "routed_skip": SKIP},
            r"routed_experts must be expert indices in \[0, 2\)",
        ),
        ({"routed_experts": EXPERTS, "routed_skip": SKIP[:2]}, r"routed_skip must be \(3, 2\) booleans"),
        ({"routed_experts": EXPERTS, "routed_skip": [[2, 0]] * 3}, r"routed_skip must be \(3, 2\) booleans"),
        (
            {"routed_experts": EXPERTS, "routed_skip": [[False, True], [False, False], [False, False]]},
            r"routed_skip marks token 0 layer 1 as skipped but routed_experts holds expert 1 there",
        ),
        (
            {"routes": [[0, 0]] * 3, "routed_experts": EXPERTS, "routed_skip": SKIP},
            "routes and routed_experts are two layouts of the same routes: give one",
        ),
        ({"routed_skip": SKIP}, "routed_skip is the skip mask of routed_experts, which the record lacks"),
        ({"routes": [[0, 3]] * 3}, r"routes must be classes in \[-1, 2\] \(the skip class is 2\)"),
        ({"routes": [[0.5, 1]] * 3}, r"routes must be classes in \[-1, 2\]"),
    ],
)
def test_routes_that_cannot_replay_are_refused_with_why(tmp_path, fields, problem):
    with pytest.raises(DataError, match=rf"rollouts\.jsonl:1: not a rollout record \({problem}"):
        _read(tmp_path, **fields)


def _skipping_model(tmp_path):
    """GRPO's test model with the skip class's balancing bias at 0 (a fresh router's -1 never
    skips), so its routes hold the skip class, expert 0 and expert 1."""
    cfg = load_config("tiny", GRPO)
    variables = init_variables(cfg.model, cfg.train.seed)
    biases = variables["balancing"]["layers"]["router"]["biases"]
    variables["balancing"]["layers"]["router"]["biases"] = biases.at[:, -1].set(0.0)
    checkpoint.save_model(tmp_path / "model", cfg, variables)
    return cfg, variables, tmp_path / "model"


def _vllm_records(cfg, variables):
    """Sampled by zaya (routes captured), written as vLLM records them: a skip rewritten to expert 0
    and marked in routed_skip; returns (records, zaya's routes of each)."""
    tokenizer, experts = load_tokenizer("byte"), cfg.model.num_experts
    prompts = [tokenizer.encode(f"<|user|>\nsay {w}<|end|>\n<|assistant|>\n").tolist() for w in ("a", "bb")]
    out = generate(
        cfg.model,
        variables,
        prompts * 4,
        max_new_tokens=6,
        temperature=1.0,
        stop_tokens=[],
        vocab_limit=tokenizer.vocab_size,  # the records' log-probabilities: over the tokenizer's ids
        return_routes=True,
    )
    records, routes = [], []
    for i, row in enumerate(out.rows()):
        routes.append(out.row_routes(i)[:-1])
        skip = routes[-1] == experts
        records.append({
            "group": i % 2, "prompt_ids": prompts[i % 2], "completion_ids": row,
            "logprobs": out.logprobs[i, : len(row)].tolist(), "reward": float(i % 3),
            "routed_experts": np.where(skip, 0, routes[-1])[..., None].tolist(), "routed_skip": skip.tolist(),
        })  # fmt: skip
    return records, routes


def _write(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _events(run, name):
    lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [e["detail"] for e in lines if e["event"] == name]


def test_vllm_routes_replay_exactly_and_a_gap_past_the_bound_stops_or_skips(tmp_path, capsys):
    cfg, variables, model = _skipping_model(tmp_path)
    records, routes = _vllm_records(cfg, variables)
    path = _write(tmp_path / "vllm.jsonl", records)
    read = read_rollout_files(load_config("tiny", [*GRPO, f"rl.rollouts={path}"]))
    for completion, expected in zip(read, routes, strict=True):
        np.testing.assert_array_equal(completion.routes, expected)  # zaya's own capture, class for class
    every = np.concatenate(routes)
    assert (every == cfg.model.num_experts).any() and (every == 0).any()  # skips and expert 0 both occur

    args = ["train", *GRPO, "--init-from", str(model), "eval.every=5", "--no-progress"]
    assert main([*args, f"rl.rollouts={path}", f"run.dir={tmp_path / 'run'}", "train.steps=1"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(line for line in lines if "loss" in line)
    # the trainer with the converted routes replayed is the sampler: no flip, the same log-probabilities
    assert first["route_flips"] == 0 and first["sampler_gap"] < 1e-5

    shifted = _write(
        tmp_path / "shifted.jsonl",
        [{**r, "logprobs": [x - 1.0 for x in r["logprobs"]]} for r in records],  # a wrong record: gap 1
    )
    capsys.readouterr()
    assert main([*args, f"rl.rollouts={shifted}", f"run.dir={tmp_path / 'stopped'}", "train.steps=2"]) == 1
    err = capsys.readouterr().err
    assert "step 1: sampler_gap 1 > rl.max_sampler_gap=0.5 (mean |log pi - log pi_sampler|" in err
    assert "resilience.on_metric_bound=stop" in err and "raise rl.max_sampler_gap (0: off)" in err

    skipped = tmp_path / "skipped"
    policy = "resilience.on_metric_bound=skip"
    assert main([*args, policy, f"rl.rollouts={shifted}", f"run.dir={skipped}", "train.steps=2"]) == 0
    events = _events(skipped, "skip")
    assert [(e["at_step"], e["reason"], e["setting"], e["bound"]) for e in events] == [
        (1, "sampler_gap", "rl.max_sampler_gap", 0.5),
        (2, "sampler_gap", "rl.max_sampler_gap", 0.5),
    ]
    assert abs(events[0]["value"] - 1.0) < 1e-4
    assert "the batch is skipped (resilience.on_metric_bound=skip" in capsys.readouterr().err
    records = [json.loads(line) for line in (skipped / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    # the same batch again, on the state the skipped step 1 kept
    assert len(losses) == 2 and losses[0] == losses[1]
