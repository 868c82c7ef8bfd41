"""Fault injection: every fault ends with a finished run and nothing lost. Where the run is
deterministic, its final parameters equal those of an uninterrupted run bit for bit.

Faults: SIGKILL while a checkpoint is being written and a corrupted latest checkpoint (together);
a crash and a hang under ``zaya supervise`` (together); SIGTERM (preemption) under the supervisor;
an injected NaN (skip, and rollback); a loss spike."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.fixtures import MINI
from tests.resilience import faults as fault_injection
from zaya_jax.checkpoint import restore_model
from zaya_jax.cli import main
from zaya_jax.config import load_config

STEPS = 8
COMMON = [
    *MINI,
    f"train.steps={STEPS}",
    "log.every=1",
    "eval.every=100",
    "checkpoint.every_steps=2",
]
CLI = [sys.executable, "-m", "zaya_jax.cli"]


def _train_cmd(run: Path, *extra: str, faults: tuple[str, ...] = ()) -> list[str]:
    """``zaya train`` with ``faults`` ("NAME=STEP", tests/resilience/faults.py) injected."""
    prefix = fault_injection.command(*faults) if faults else CLI
    return [*prefix, "train", *COMMON, f"run.dir={run}", *extra, "--no-progress"]


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def _final_params(run: Path) -> dict:
    _, variables, step = restore_model(run / "checkpoints" / str(STEPS))
    assert step == STEPS
    return variables["params"]


def _assert_same_params(run: Path, reference: Path) -> None:
    for a, b in zip(
        jax.tree.leaves(_final_params(run)), jax.tree.leaves(_final_params(reference)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _metrics(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "loss" in line]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    assert sorted(steps) == list(range(1, STEPS + 1))
    return lines


def _nan_at(step: int) -> fault_injection.FaultHook:
    """The step's host batch gets a NaN loss mask (injected in-process, through the hook interface)."""
    return fault_injection.FaultHook({"nan_at_step": step})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    _run(_train_cmd(run))
    return run


def test_kill_during_save_and_corrupted_checkpoint_lose_nothing(tmp_path, reference):
    run = tmp_path / "run"
    # step 4's checkpoint is overwritten with garbage, then the process dies while writing step 6
    injected = ("corrupt_checkpoint_at_step=4", "crash_during_save_at_step=6")
    crashed = _run(_train_cmd(run, faults=injected), check=False)
    assert crashed.returncode == -signal.SIGKILL
    rerun = _run(_train_cmd(run, faults=injected))
    events = _events(run)
    unreadable = [e for e in events if e["event"] == "checkpoint_unreadable"]
    resumed = [e["detail"]["from_step"] for e in events if e["event"] == "resume"]
    if (run / "quarantine").exists():  # step 6 never committed: 4 is the latest and is unreadable
        assert [e["detail"]["checkpoint"] for e in unreadable] == [4]
        assert [p.name.split("-")[0] for p in (run / "quarantine").iterdir()] == ["4"]
        assert resumed == [2]
    else:  # the async save of 6 committed before the kill: resume from 6, 4 was never needed
        assert resumed == [6]
    assert "cannot be used" in rerun.stderr or not unreadable
    _metrics(run)
    _assert_same_params(run, reference)


def test_crash_and_hang_under_supervise(tmp_path, reference):
    run = tmp_path / "run"
    sup = [*CLI, "supervise", "--backoff", "0.1", "--max-restarts", "3", "--"]
    child = _train_cmd(run, "resilience.hang_timeout_s=3", faults=("hang_at_step=3", "crash_at_step=5"))
    result = _run([*sup, *child])
    events = _events(run)
    failed = [e["detail"]["cause"] for e in events if e["event"] == "child_failed"]
    assert failed == ["hang watchdog (no progress; stacks in hang_stacks.txt)", "killed by SIGKILL"], failed
    assert [e["event"] for e in events].count("restart") == 2
    assert [e["event"] for e in events[-2:]] == ["child_exit", "goodput"]  # the supervisor's report
    assert events[-1]["detail"]["attempts"] == 3 and events[-1]["detail"]["badput_s"]["restart_gap"] > 0
    stacks = (run / "hang_stacks.txt").read_text()
    assert "no progress" in stacks and "Thread" in stacks and "hang" in stacks  # faults.hang in a stack
    assert any(e["event"] == "hang" for e in events)
    assert "restart" in result.stderr
    _metrics(run)
    _assert_same_params(run, reference)


def test_a_step_stuck_past_runtime_collective_timeout_s_ends_the_process_for_a_restart(tmp_path):
    run = tmp_path / "run"
    extra = ("runtime.collective_timeout_s=1", "resilience.hang_timeout_s=600")
    result = _run(_train_cmd(run, *extra, faults=("hang_at_step=3",)), check=False)  # not a saved step
    assert result.returncode == 75, result.stderr[-2000:]  # zaya supervise restarts it
    (event,) = [e for e in _events(run) if e["event"] == "collective_timeout"]
    assert event["step"] in (3, 4) and event["detail"]["action"] == "drain"  # 4: dispatched ahead
    assert f"collective_timeout: step {event['step'] + 1} has waited" in result.stderr


def test_sigterm_under_supervise_saves_and_resumes(tmp_path, reference):
    run = tmp_path / "run"
    # the child pauses after step 3 (a fault that fires once per run directory): the preemption
    # reaches it there, forwarded by the supervisor, whatever the machine's speed
    child = [*fault_injection.command("pause_at_step=3"), "train", *COMMON, f"run.dir={run}", "--no-progress"]
    cmd = [*CLI, "supervise", "--backoff", "0.1", "--", *child]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fault_injection.signal_while_paused(run, 3, [proc], signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    events = _events(run)
    assert "restart" not in [e["event"] for e in events]  # a preempted child is not restarted
    stopped = [e for e in events if e["event"] == "stop"]
    assert [(e["step"], e["detail"]["signal"]) for e in stopped] == [(4, "SIGTERM")]  # the step after
    _run(cmd)  # the job is requeued: the same command finishes the run
    _metrics(run)
    _assert_same_params(run, reference)


def test_injected_nan_is_skipped(tmp_path, capsys):
    run = tmp_path / "skip"
    assert main(["train", *COMMON, f"run.dir={run}", "--no-progress"], hooks=[_nan_at(3)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == STEPS and np.isfinite(summary["final_loss"])
    skips = [e for e in _events(run) if e["event"] == "skip"]
    assert [(e["detail"]["at_step"], e["detail"]["reason"]) for e in skips] == [(3, "nonfinite")]
    lines = _metrics(run)
    assert [line["skipped_steps"] for line in lines if "loss" in line] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(_final_params(run)))


def test_injected_nan_rolls_back_and_skips_the_data_window(tmp_path, capsys):
    run = tmp_path / "rollback"
    args = ["train", *COMMON, f"run.dir={run}", "resilience.on_nonfinite=rollback"]
    assert main([*args, "--no-progress"], hooks=[_nan_at(5)]) == 0
    capsys.readouterr()
    rollbacks = [e["detail"] for e in _events(run) if e["event"] == "rollback"]
    assert rollbacks == [{"reason": "nonfinite", "from_step": 5, "to_step": 4}]
    lines = _metrics(run)
    train_lines = {line["step"]: line for line in lines if "loss" in line}
    assert train_lines[STEPS]["rollbacks"] == 1
    # the batch of the bad step was skipped: the data position is one batch ahead of the step count
    assert train_lines[STEPS]["tokens_seen"] == (STEPS + 1) * 2 * 32


def test_nonfinite_stop_exits_with_the_reason(tmp_path, capsys):
    run = tmp_path / "stop"
    args = ["train", *COMMON, f"run.dir={run}", "resilience.on_nonfinite=stop"]
    assert main([*args, "--no-progress"], hooks=[_nan_at(3)]) == 1
    assert "resilience.on_nonfinite=stop" in capsys.readouterr().err
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2]


def test_supervise_gives_up_on_a_configuration_error(tmp_path):
    run = tmp_path / "bad"
    result = _run(
        [*CLI, "supervise", "--run-dir", str(run), "--", "zaya", "train", "model.num_experts=0"], check=False
    )
    assert result.returncode == 2
    assert [e["event"] for e in _events(run)] == ["child_start", "child_failed", "give_up"]


def test_loading_paths_never_unpickle_or_execute():
    package = Path(__file__).resolve().parents[2] / "zaya_jax"
    forbidden = re.compile(
        r"import pickle|pickle\.loads?\(|yaml\.load\(|yaml\.unsafe_load|torch\.load"
        r"|(?<![\w.])eval\(|(?<![\w.])exec\("
    )
    offenders = [
        f"{path.relative_to(package)}: {match.group()}"
        for path in package.rglob("*.py")
        for match in forbidden.finditer(path.read_text())
    ]
    assert not offenders, offenders
    # a run name cannot climb out of runs/
    with pytest.raises(ValueError, match="plain directory name"):
        load_config("tiny", ["run.name=../../etc"])
