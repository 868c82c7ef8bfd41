"""GRPO on two processes (jax.distributed, 4 CPU devices each, one 8-device mesh): each process
samples its half of every rollout's rows on its own devices, the completions are gathered so that
both build the same global rollout, and each trains its rows of every batch. The losses equal a
one-process run's with the same seeds (row i of a rollout draws from the stream (seed, i) whichever
process samples it). A run sampling ahead (rl.max_staleness), stopped (SIGTERM) and saved by two
processes, resumed by one, continues the same prompt stream and the rollout in flight and ends with
the uninterrupted one-process run's losses and rewards. With parameters split across the processes
(fsdp spanning them: the sampler gets them gathered), a rollback (an injected NaN) with rollouts
scored against reference weights (rl.kl) goes as in one process."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.parallel.processes import (
    GRPO,
    assert_same_training,
    finish,
    one_process,
    start_two_processes,
    train_metrics,
)
from tests.resilience import faults
from zaya_jax.checkpoint import restore_model

STEPS = 4


def _evaluations(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "eval_loss" in line]


def _positions(run: Path, step: int) -> list[dict]:
    data = run / "checkpoints" / str(step) / "data"
    return [json.loads(p.read_text()) for p in sorted(data.glob("process_*"))]


AHEAD = ["rl.max_staleness=1", "rl.tis_cap=2"]


@pytest.fixture(scope="module")
def ahead_reference(tmp_path_factory) -> Path:
    """The one-process run sampling ahead: the reference of the resumed run below, and the starting
    weights (train.init_from) of the KL run above."""
    run = tmp_path_factory.mktemp("grpo_reference") / "run"
    one_process(run, STEPS, *AHEAD)
    return run


def _assert_same_weights(run: Path, reference: Path) -> None:
    ours, theirs = (restore_model(r / "checkpoints" / str(STEPS))[1] for r in (run, reference))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_split_parameters_a_rollback_and_a_kl_reference_on_two_processes_equal_one(tmp_path, ahead_reference):
    """With the parameters split across the processes (fsdp over 4 devices, 2 in each process: the
    sampler gets them gathered), a NaN injected into step 3's batch rolls both processes back to
    step 2 (agreed), and the run, scoring its rollouts against the reference weights (rl.kl, each
    process its rows), goes on as the one-process run with the same fault does: the same losses,
    rewards, held-out rewards, saved positions (both processes the same) and weights."""
    extra = [
        "mesh.data=1",
        "mesh.fsdp=4",
        "resilience.on_nonfinite=rollback",
        "rl.kl=0.05",
        f"train.init_from={ahead_reference}",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    one_process(one, STEPS, *extra, fault=("nan_at_step=3",))
    finish(start_two_processes(two, STEPS, *GRPO, *extra, fault=("nan_at_step=3",)))
    for run in (one, two):
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        rollbacks = [e["detail"] for e in events if e["event"] == "rollback"]
        assert rollbacks == [{"reason": "nonfinite", "from_step": 3, "to_step": 2}]
    ours, theirs = train_metrics(two), train_metrics(one)
    assert theirs[STEPS]["rollbacks"] == 1 and all(
        theirs[s]["kl"] > 0 for s in (3, 4)
    )  # moved off the reference
    for s in range(1, STEPS + 1):
        assert ours[s]["kl"] == pytest.approx(theirs[s]["kl"], rel=1e-5), s
    assert_same_training(ours, theirs, list(range(1, STEPS + 1)))
    # held-out reward: every process evaluates every held-out prompt, as one process does
    evaluated, reference_evaluated = _evaluations(two), _evaluations(one)
    assert [e["step"] for e in evaluated] == [e["step"] for e in reference_evaluated]
    assert evaluated[0]["step"] == 0 and evaluated[-1]["step"] == STEPS  # the start, ..., the end
    assert [e["eval_loss"] for e in evaluated] == [e["eval_loss"] for e in reference_evaluated]
    # both processes saved the same global position (rollouts taken, prompts consumed, tokens
    # trained), the one-process run's
    positions = _positions(two, STEPS)
    assert len(positions) == 2 and positions[0] == positions[1] == _positions(one, STEPS)[0]
    assert positions[0]["rollouts"] >= STEPS // 2
    _assert_same_weights(two, one)


def test_two_processes_sampling_ahead_resumed_by_one_continue_the_prompt_stream(tmp_path, ahead_reference):
    """rl.max_staleness=1 on two processes: each samples its rows of the next rollout on a thread
    while the current one trains (the rows gathered on the main thread). Stopped (SIGTERM, agreed
    at step 2, the end of the first rollout) and saved by both with the weights of the rollout in
    flight (version 0: rollout 1 of 2 steps each is sampled from rollout 0's weights), resumed by
    one process, the run continues the prompt stream, samples that rollout again from those weights
    and ends as the one-process run sampling ahead does."""
    ahead, reference, run = AHEAD, ahead_reference, tmp_path / "run"
    procs = start_two_processes(run, STEPS, *GRPO, *ahead, fault=("pause_at_step=1",))
    faults.signal_while_paused(run, 1, procs, {0: signal.SIGTERM, 1: signal.SIGTERM}, processes=2)
    summaries = [json.loads(r.stdout[r.stdout.index("{") :]) for r in finish(procs)]
    assert summaries[0]["interrupted"] and summaries[0]["steps"] == summaries[1]["steps"] == 2
    positions = _positions(run, 2)
    assert len(positions) == 2 and positions[0] == positions[1] == _positions(reference, 2)[0]
    assert positions[0]["consumed"] == 4 and positions[0]["ahead"] == [0]
    one_process(run, STEPS, *ahead)  # the same run directory, continued by one process
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["detail"]["from_step"] for e in events if e["event"] == "resume"] == [2]
    ours, theirs = train_metrics(run), train_metrics(reference)
    assert_same_training(ours, theirs, list(range(1, STEPS + 1)))
    assert [ours[s]["staleness"] for s in range(1, STEPS + 1)] == [0, 0, 2, 2]
    assert _positions(run, STEPS) == _positions(reference, STEPS)  # one process's position now
    _assert_same_weights(run, reference)
