"""Rollouts sampled ahead (``rl.max_staleness = k``): rollout j comes from the weights rollout
j - k started training with, whatever the timing, so a producer sampling ahead gives exactly the
batches of a synchronous one fed those stale weights; the weights in flight, handed back after a
checkpoint, make a resumed producer continue as the uninterrupted one. A run killed (SIGKILL) while
sampling ahead resumes from its last checkpoint and ends with the uninterrupted run's losses,
rewards and weights, bit for bit."""

from __future__ import annotations

import json
import signal
import subprocess
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures import GRPO
from tests.resilience import faults
from zaya_jax.checkpoint import restore_model
from zaya_jax.cli import main
from zaya_jax.config import ConfigError, load_config
from zaya_jax.data import load_tokenizer
from zaya_jax.model import init_variables
from zaya_jax.objectives.rollouts import Rollouts


class _State(NamedTuple):
    """What :meth:`Rollouts.observe` reads of a TrainState."""

    params: Any
    balancing: Any
    step: jax.Array


def _states(cfg, count: int) -> list[_State]:
    """Weights that differ at every step (versions 0 .. count - 1), as a training run's would."""
    variables = init_variables(cfg.model, 0)
    return [
        _State(jax.tree.map(lambda x, v=v: x * (1 + 0.1 * v), variables["params"]), variables["balancing"], jnp.int32(v))
        for v in range(count)
    ]  # fmt: skip


def _draw(rollouts: Rollouts, observed: list[_State]) -> list[tuple[dict, dict, dict]]:
    """(rollout statistics, batch, data position) of one batch per state observed."""
    out = []
    for state in observed:
        rollouts.observe(state)
        plan, batch, position = rollouts()
        out.append((dict(plan.rollout), batch, position))
    return out


def _assert_same_batches(ours: list, theirs: list) -> None:
    for (our_stats, ours_batch, _), (their_stats, theirs_batch, _) in zip(ours, theirs, strict=True):
        assert ours_batch.keys() == theirs_batch.keys()
        for key in theirs_batch:
            np.testing.assert_array_equal(ours_batch[key], theirs_batch[key], err_msg=key)
        assert our_stats | {"staleness": 0} == their_stats | {"staleness": 0}  # a synchronous one has none


@pytest.mark.parametrize("k", [1, 2])
def test_sampled_ahead_equals_a_synchronous_producer_fed_the_stale_weights(k):
    cfg = load_config("tiny", [*GRPO, f"rl.max_staleness={k}"])
    states = _states(cfg, 4)
    ahead = Rollouts(cfg, load_tokenizer("byte"))
    try:
        ours = _draw(ahead, states)
    finally:
        ahead.close()
    stale = [states[max(0, j - k)] for j in range(4)]  # rollout j: the weights of rollout j - k's step
    theirs = _draw(Rollouts(load_config("tiny", GRPO), load_tokenizer("byte")), stale)
    _assert_same_batches(ours, theirs)
    assert [stats["staleness"] for stats, _, _ in ours] == [min(j, k) for j in range(4)]
    # the position names the versions in flight: rollouts j + 1 .. j + k, next first
    assert [position["ahead"] for _, _, position in ours] == [
        [max(0, i - k) for i in range(j + 1, j + k + 1)] for j in range(4)
    ]


def test_a_producer_resumed_with_the_weights_in_flight_continues_the_uninterrupted_one():
    cfg = load_config("tiny", [*GRPO, "rl.max_staleness=1"])
    states = _states(cfg, 4)
    uninterrupted = Rollouts(cfg, load_tokenizer("byte"))
    try:
        first = _draw(uninterrupted, states[:2])
        position, weights = first[-1][2], uninterrupted.ahead_weights()
        rest = _draw(uninterrupted, states[2:])
    finally:
        uninterrupted.close()
    resumed, asked = Rollouts(cfg, load_tokenizer("byte")), []
    try:
        resumed.set_state([position])
        resumed.resume_ahead(lambda count: asked.append(count) or weights)
        again = _draw(resumed, states[2:])
        _assert_same_batches(again, rest)
        assert [stats["staleness"] for stats, _, _ in again] == [1, 1]
    finally:
        resumed.close()
    assert asked == [1]
    # without the weights (another rl.max_staleness saved them, or none), the rollouts in flight
    # are sampled from the resumed weights, and the run says so
    events = []
    fresh = Rollouts(cfg, load_tokenizer("byte"), event=lambda name, **detail: events.append(name))
    try:
        fresh.set_state([position])
        fresh.resume_ahead(lambda count: None)
        (stats, _, _), _ = _draw(fresh, states[2:])
    finally:
        fresh.close()
    assert events == ["rollouts_resampled"] and stats["staleness"] == 0


def test_sampling_ahead_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match=r"rl\.max_staleness=-1 must be >= 0"):
        load_config("tiny", [*GRPO, "rl.max_staleness=-1"])
    with pytest.raises(ConfigError, match="rollouts read from files"):
        load_config("tiny", [*GRPO, "rl.max_staleness=1", "rl.rollouts=some.jsonl"])


def _metrics(run) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "loss" in line]
    assert len(steps) == len(set(steps)), "a resumed run must not log a step twice"
    return {line["step"]: line for line in lines if "loss" in line}


def test_a_run_killed_while_sampling_ahead_resumes_bit_identical(tmp_path):
    """Checkpoints every 2 steps, killed (SIGKILL) after step 3 with the next rollout being sampled:
    the run resumes from step 2, samples the rollout of step 3 again from the weights saved with it
    (version 1), and ends with the uninterrupted run's every metric and weight."""
    args = [*GRPO, "rl.max_staleness=1", "rl.tis_cap=2", "train.steps=4", "checkpoint.every_steps=2"]
    args += ["checkpoint.async_save=false"]  # step 2 is committed before the kill, whatever the timing
    args += ["eval.every=4", "--no-progress"]
    reference = tmp_path / "reference"
    assert main(["train", *args, f"run.dir={reference}"]) == 0
    run = tmp_path / "killed"
    cmd = [*faults.command("crash_at_step=3"), "train", *args, f"run.dir={run}"]
    crashed = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert main(["train", *args, f"run.dir={run}"]) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["detail"]["from_step"] for e in events if e["event"] == "resume"] == [2]
    assert "rollouts_resampled" not in {e["event"] for e in events}
    ours, theirs = _metrics(run), _metrics(reference)
    assert [theirs[s]["staleness"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    for step in (3, 4):  # trained after the resume: every number as the uninterrupted run's
        keep = ("loss", "reward", "sampler_gap", "ratio", "grad_norm", "staleness", "mismatch_kl")
        assert {k: ours[step][k] for k in keep} == {k: theirs[step][k] for k in keep}, step
    # nothing is sampled past the final step's rollout: the last checkpoint holds no weights ahead
    final = json.loads((run / "checkpoints" / "4" / "data" / "process_0-of-1.json").read_text())
    assert final["ahead"] == [] and not (run / "checkpoints" / "4" / "ahead").exists()
    ours_w, theirs_w = (restore_model(r / "checkpoints" / "4")[1] for r in (run, reference))
    for a, b in zip(jax.tree.leaves(ours_w), jax.tree.leaves(theirs_w), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
