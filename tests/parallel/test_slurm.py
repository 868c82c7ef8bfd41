"""Launching through a real Slurm cluster: one node on this machine (tests/slurm/cluster.sh, which
``.ci/run`` starts as root). ``srun -n 2 zaya train`` with 4 CPU devices per task meets on one
8-device mesh through JAX's Slurm detection, with no coordinator flags; ``scancel --signal=TERM``
stops both tasks at the same step, after both saved it, and each exits 0; ``zaya supervise`` as
each task restarts its crashed trainer, and the restarted pair meets again and finishes. Where no
cluster runs (not root, no ``slurm-wlm``), these tests skip saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.parallel.test_multiprocess import two_process_args
from tests.resilience import faults

REPO = Path(__file__).resolve().parents[2]


def _cluster_up() -> str | None:
    """None when a Slurm node is up, else why not."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "srun/sinfo are not installed (slurm-wlm; .ci/run installs it as root)"
    state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if state.returncode != 0 or not any(s in state.stdout for s in ("idle", "mixed", "allocated")):
        return (
            f"no Slurm node is up (tests/slurm/cluster.sh starts one as root): {state.stderr.strip()[:200]}"
        )
    return None


pytestmark = pytest.mark.skipif(_cluster_up() is not None, reason=str(_cluster_up()))


def _env() -> dict[str, str]:
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def _srun(name: str, *command: str) -> list[str]:
    return ["srun", "-n", "2", f"--job-name={name}", "--kill-on-bad-exit=1", *command]


def _train_args(run: Path, steps: int) -> list[str]:
    return ["train", *two_process_args(run, steps), "--no-progress"]


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def test_srun_launches_two_tasks_on_one_mesh_through_slurm_detection(tmp_path):
    run = tmp_path / "run"
    cmd = _srun(f"zaya-{uuid.uuid4().hex[:8]}", sys.executable, "-m", "zaya_jax.cli", *_train_args(run, 4))
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    (start,) = [e["detail"] for e in _events(run) if e["event"] == "start"]
    assert start["devices"] == 8 and start["mesh"] == {"data": 2, "fsdp": 2, "expert": 2, "context": 1}
    final = run / "checkpoints" / "4"
    assert {p.name for p in (final / "data").glob("process_*")} == {
        "process_0-of-2.json",
        "process_1-of-2.json",
    }
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (final / "params").iterdir()}


def _losses(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def test_scancel_sigterm_stops_both_tasks_at_the_same_step_and_one_task_resumes_on_the_same_rows(tmp_path):
    run, name = tmp_path / "run", f"zaya-{uuid.uuid4().hex[:8]}"
    cmd = _srun(name, *faults.command("pause_at_step=2"), *_train_args(run, 6))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env()
    )
    try:
        for process in (0, 1):  # both tasks hold after step 2, so the signal lands there
            faults.wait_for_file(faults.paused_marker(run, 2, process), [proc])
        job = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True)
        assert job.stdout.strip(), job.stderr
        subprocess.run(["scancel", "--signal=TERM", job.stdout.split()[0]], check=True, timeout=60)
        for process in (0, 1):
            faults.wait_for_file(faults.signalled_marker(run, 2, process), [proc])
        faults.release(run, 2)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    stops = [(e["step"], e["detail"]) for e in _events(run) if e["event"] == "stop"]
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert stops == [(saved[-1], {"signal": "SIGTERM", "received_by": [0, 1]})], (stops, saved)
    assert saved[-1] < 6  # stopped early, the stop step saved by both tasks
    assert {p.name for p in (run / "checkpoints" / str(saved[-1]) / "data").iterdir()} >= {
        "process_0-of-2.json",
        "process_1-of-2.json",
    }

    # Elastic data: the job continues as 2 tasks and, from a copy, as 1 task of 8 devices (the same
    # mesh). Both train on the same rows, so every later loss agrees to rounding (another row would
    # move it by ~1e-2); two-task resume is bit-identical to an uninterrupted run (test_multiprocess).
    one = tmp_path / "one"
    shutil.copytree(run, one)
    for where, tasks in ((run, "2"), (one, "1")):
        env = {
            **_env(),
            "XLA_FLAGS": _env()["XLA_FLAGS"] + (" --xla_force_host_platform_device_count=8" * (tasks == "1")),
        }
        cmd = [
            "srun",
            "-n",
            tasks,
            f"--job-name={name}-{tasks}",
            "--kill-on-bad-exit=1",
            sys.executable,
            "-m",
            "zaya_jax.cli",
            *_train_args(where, 6),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
        assert result.returncode == 0, result.stderr[-4000:]
    (start,) = [e["detail"] for e in _events(one) if e["event"] == "start" and e["detail"]["processes"] == 1]
    assert start["devices"] == 8
    two_tasks, one_task = _losses(run), _losses(one)
    assert sorted(one_task) == list(range(1, 7))
    for step in range(saved[-1] + 1, 7):
        assert one_task[step] == pytest.approx(two_tasks[step], rel=1e-5), step


def test_zaya_supervise_under_srun_restarts_crashed_tasks_that_meet_again(tmp_path):
    run = tmp_path / "run"
    child = [*faults.command("crash_at_step=3"), *_train_args(run, 5)]
    supervise = [sys.executable, "-m", "zaya_jax.cli", "supervise", "--max-restarts", "3", "--backoff", "1"]
    cmd = _srun(f"zaya-{uuid.uuid4().hex[:8]}", *supervise, "--", *child)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    events = _events(run)
    failed = [e["detail"]["cause"] for e in events if e["event"] == "child_failed"]
    assert failed == ["killed by SIGKILL"] * 2  # both tasks' trainers crashed at step 3
    assert [e["event"] for e in events].count("restart") == 2
    assert [e["detail"]["from_step"] for e in events if e["event"] == "resume"] == [2]
    (end,) = [e["detail"] for e in events if e["event"] == "end"]
    assert end["steps"] == 5 and not end["interrupted"]
