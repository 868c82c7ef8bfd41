"""Two local processes x 4 CPU devices (jax.distributed, gloo collectives) train a miniature model
on one 8-device mesh and save checkpoints (each process writing its own shards). Decisions that must
be collective are agreed by both processes (``zaya_jax.train.consensus``): a time-based save that
only one process's clock calls for, and a SIGINT to one process with a SIGTERM to the other, end
with both processes saving the same step, recording the stop (SIGTERM, received by both) and
exiting 0; a second launch restores the checkpoint across both processes and finishes
bit-identical to an uninterrupted run. A run keeping a local tier (``checkpoint.local_dir``: each
process its own shards in its own directory), killed, resumes from the newest local step both
processes hold, bit-identical too; a step only one of them holds is passed over and deleted. A GPU of process 1 reporting ECC errors drains both
processes at the same step, saved by both (``resilience.on_unhealthy=drain``)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

import zaya_jax
from tests.parallel.processes import finish, start_two_processes
from tests.resilience import faults
from zaya_jax.checkpoint import restore_model
from zaya_jax.resilience.health import DRAIN_RECORD, EXIT_DRAIN

STEPS = 6


def _launch(run: Path, steps: int, *extra: str) -> list[subprocess.CompletedProcess]:
    return finish(start_two_processes(run, steps, *extra))


def _summary(result: subprocess.CompletedProcess) -> dict:
    return json.loads(result.stdout[result.stdout.index("{") :])


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _steps(checkpoints: Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def _saved(run: Path) -> list[int]:
    return _steps(run / "checkpoints")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    _launch(run, STEPS)
    return run


def test_signals_to_each_process_and_one_clock_due_both_save_stop_and_resume_exactly(tmp_path, reference):
    run = tmp_path / "run"
    # process 1's save clock runs 10^5 s ahead: a time-based save is due by its clock after every
    # step and never by process 0's; SIGINT goes to process 0 and SIGTERM to process 1 at step 3
    # (step by step: dispatched ahead, an odd step's agreed save would land on the next, even step,
    # which saves anyway; tests/train/test_resume.py::test_time_based_checkpoints_and_keep_policy covers that placement)
    procs = start_two_processes(
        run, STEPS, "checkpoint.every_minutes=60", "train.dispatch_ahead=false", clock_skew=100000,
        fault=("pause_at_step=3",),
    )  # fmt: skip
    faults.signal_while_paused(run, 3, procs, {0: signal.SIGINT, 1: signal.SIGTERM}, processes=2)
    first = finish(procs)  # both exit 0: no process waits in a barrier the other never reaches
    summaries = [_summary(r) for r in first]
    assert summaries[0]["interrupted"] and summaries[0]["steps"] == summaries[1]["steps"] == 4
    stopped = summaries[0]["steps"]  # the step after the signals
    stops = [e for e in _events(run) if e["event"] == "stop"]
    # SIGTERM (a scheduler's preemption) is named before SIGINT; both receivers are recorded
    assert [(e["step"], e["detail"]) for e in stops] == [
        (stopped, {"signal": "SIGTERM", "received_by": [0, 1]})
    ]
    saved = _saved(run)
    assert saved[-1] == stopped and any(s % 2 for s in saved), saved  # odd steps: the agreed time saves
    for step in saved:  # every saved step holds both processes' data positions and shards
        step_dir = run / "checkpoints" / str(step)
        assert {p.name for p in (step_dir / "data").glob("process_*")} == {
            "process_0-of-2.json",
            "process_1-of-2.json",
        }
        assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (step_dir / "params").iterdir()}

    _launch(run, STEPS)  # the job is requeued: both processes restore the stop step and finish
    assert [e["detail"]["from_step"] for e in _events(run) if e["event"] == "resume"] == [stopped]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == list(range(1, STEPS + 1))  # process 0 only
    start = [e["detail"] for e in _events(run) if e["event"] == "start"][-1]  # the second launch's
    assert start["devices"] == 8 and start["mesh"] == {"data": 2, "fsdp": 2, "expert": 2, "context": 1}
    ours, theirs = (restore_model(r / "checkpoints" / str(STEPS))[1] for r in (run, reference))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lm = zaya_jax.load(run)  # saved on 8 devices in 2 processes, verified and loaded on one
    assert lm.step == STEPS and np.isfinite(lm.logits([[5, 6, 7]])).all()


def test_a_killed_run_resumes_from_the_newest_local_step_both_processes_hold_exactly(tmp_path, reference):
    run, local = tmp_path / "run", tmp_path / "ramdisk"
    tier = [f"checkpoint.local_dir={local}", "checkpoint.local_every_steps=1"]
    procs = start_two_processes(run, STEPS, *tier, "train.dispatch_ahead=false", fault=("crash_at_step=3",))
    assert [proc.wait(timeout=600) for proc in procs] == [-signal.SIGKILL] * 2  # each killed itself
    (root,) = local.iterdir()  # <run name>-<hash>: a directory per process
    tiers = [root / f"process_{i}-of-2" / "checkpoints" for i in range(2)]
    assert _saved(run) == [2] and [_steps(t) for t in tiers] == [[1, 3], [1, 3]]  # 2: persistent only
    assert [p.name for p in (tiers[1] / "3" / "params").glob("ocdbt.process_*")] == ["ocdbt.process_1"]
    # process 0 alone holds a newer step (process 1 killed before committing it): never restored
    shutil.copytree(tiers[0] / "3", tiers[0] / "4")
    _launch(run, STEPS, *tier)
    assert [e["detail"] for e in _events(run) if e["event"] == "resume"] == [
        {"from_step": 3, "tier": "local"}
    ]
    assert _steps(tiers[0]) == _steps(tiers[1]) == [3, STEPS - 1]  # 4 deleted; 6 is saved persistently
    ours, theirs = (restore_model(r / "checkpoints" / str(STEPS))[1] for r in (run, reference))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_unhealthy_gpu_on_one_process_drains_both_at_the_same_step(tmp_path, monkeypatch):
    """Process 1's (fake) amd-smi reports uncorrectable ECC errors after step 1: the finding rides
    on the step's agreement, so both processes stop after step 2, save it and exit 76."""
    _, env = faults.fake_amd_smi(tmp_path / "smi")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = tmp_path / "run"
    procs = start_two_processes(
        run, 4, "train.dispatch_ahead=false", "resilience.health_every_s=0.05", fault=("gpu_ecc_at_step=1",)
    )
    results = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [EXIT_DRAIN, EXIT_DRAIN], results[0][1][-3000:]
    drain = json.loads((run / DRAIN_RECORD).read_text())
    assert drain["step"] == 2 and [f["probe"] for f in drain["findings"]] == ["gpu"]
    (health,) = [e for e in _events(run) if e["event"] == "health"]
    assert health["step"] == 2 and health["detail"]["process"] == 1  # found on process 1, recorded by 0
    assert [e["detail"]["signal"] for e in _events(run) if e["event"] == "stop"] == ["drain"]
    assert _saved(run) == [2]
    assert {p.name for p in (run / "checkpoints" / "2" / "data").glob("process_*")} == {
        "process_0-of-2.json",
        "process_1-of-2.json",
    }
    assert "refusing" not in results[0][1] and "saved step 2" in results[0][1]
