"""``train.dispatch_ahead``: step t+1 is dispatched before step t's outcome is read, and the run is
the one the step-by-step loop makes: the same losses, parameters, rollbacks and data positions; a
rollback, a stop signal or a time-based save decided at a step dispatched past acts one step later;
steps whose state a hook reads are finished before the next dispatch."""

from __future__ import annotations

import json
import os
import signal

import jax
import numpy as np
import pytest

from tests.fixtures import MINI
from tests.resilience import faults as fault_injection
from zaya_jax.checkpoint import restore_model
from zaya_jax.cli import main
from zaya_jax.train.hooks import Hook

COMMON = [
    *MINI,
    "train.steps=6",
    "log.every=1",
    "eval.every=100",
    "checkpoint.every_steps=4",
    "--no-progress",
]


class Order(Hook):
    """Records the loop's calls: ("before", t) and ("after", t, whether end.state was given)."""

    def __init__(self):
        self.calls = []

    def before_step(self, step, batch):
        self.calls.append(("before", step))
        return batch

    def after_step(self, end):
        self.calls.append(("after", end.step, end.state is not None))


def test_the_next_step_is_dispatched_before_the_outcome_is_read(tmp_path, capsys):
    order = Order()
    assert main(["train", *COMMON, f"run.dir={tmp_path / 'run'}"], hooks=[order]) == 0
    b, a = "before", "after"
    # steps 4 (a save) and 6 (the last, evaluated) are finished before the next dispatch, with their state
    assert order.calls == [
        (b, 1), (b, 2), (a, 1, False), (b, 3), (a, 2, False), (b, 4), (a, 3, False), (a, 4, True),
        (b, 5), (b, 6), (a, 5, False), (a, 6, True),
    ]  # fmt: skip
    order = Order()
    assert (
        main(["train", *COMMON, "train.dispatch_ahead=false", f"run.dir={tmp_path / 'sync'}"], hooks=[order])
        == 0
    )
    assert order.calls == [call for step in range(1, 7) for call in (("before", step), ("after", step, True))]


def _run(run, capsys, *extra, hooks=()):
    assert main(["train", *COMMON, f"run.dir={run}", *extra], hooks=list(hooks)) == 0, capsys.readouterr().err
    capsys.readouterr()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines if "loss" in line}, events


def test_a_rollback_decided_one_step_late_trains_what_the_step_by_step_loop_trains(tmp_path, capsys):
    """A NaN at step 5 (dispatched past: step 6 is already running when its outcome is read) rolls
    back to step 4; the discarded step 6's batch is trained again as step 5, so losses, learning
    rates, data positions and the final parameters equal the step-by-step loop's."""
    runs = {}
    for ahead in (True, False):
        run = tmp_path / f"ahead_{ahead}"
        hook = fault_injection.FaultHook({"nan_at_step": 5})
        records, events = _run(
            run, capsys, "resilience.on_nonfinite=rollback", f"train.dispatch_ahead={ahead}", hooks=[hook]
        )
        rollbacks = [e["detail"] for e in events if e["event"] == "rollback"]
        assert rollbacks == [{"reason": "nonfinite", "from_step": 5, "to_step": 4}]
        runs[ahead] = records, restore_model(run / "checkpoints" / "6")[1]["params"]
    (ahead, params_ahead), (sync, params_sync) = runs[True], runs[False]
    assert sorted(ahead) == sorted(sync) == list(range(1, 7))
    for step in ahead:
        for key in ("loss", "lr", "muon_lr", "tokens_seen", "rollbacks", "skipped_steps"):
            np.testing.assert_allclose(
                ahead[step][key], sync[step][key], rtol=1e-6, err_msg=f"{key} at {step}"
            )
    assert ahead[6]["tokens_seen"] == 7 * 2 * 32  # the bad batch skipped, the discarded one trained
    for x, y in zip(jax.tree.leaves(params_ahead), jax.tree.leaves(params_sync), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


class SignalAt(Hook):
    def __init__(self, step):
        self.step = step

    def before_step(self, step, batch):
        if step == self.step:  # step 2 is running ahead of its outcome: the stop is agreed there
            os.kill(os.getpid(), signal.SIGTERM)
        return batch


@pytest.mark.parametrize("ahead", [True, False])
def test_a_stop_signal_saves_the_step_it_reached(tmp_path, capsys, ahead):
    run = tmp_path / "run"
    args = ["train", *COMMON, f"run.dir={run}", f"train.dispatch_ahead={ahead}"]
    assert main(args, hooks=[SignalAt(3)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 3 and summary["interrupted"]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["detail"]["signal"] for e in events if e["event"] == "stop"] == ["SIGTERM"]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [3]
