"""Launching through a real Slurm cluster: one node on this machine (tests/slurm/cluster.sh, which
``.ci/run`` starts as root). ``srun -n 2 zaya train`` with 4 CPU devices per task meets on one
8-device mesh through JAX's Slurm detection, with no coordinator flags; ``scancel --signal=TERM``
stops both tasks at the same step, after both saved it, and each exits 0, and ``srun -n 1`` then
continues the job on one task with the same rows (elastic data); ``zaya supervise`` as each task
restarts its crashed trainer, and the restarted pair meets again and finishes. (Two processes of
GRPO train what one trains: tests/parallel/test_multiprocess_grpo.py; they meet the same way.)
Where no cluster runs (not root, no ``slurm-wlm``), these tests skip saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.parallel.processes import two_process_args
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


STEPS = 4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """``srun -n 2 zaya train`` for STEPS steps, start to end."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    cmd = _srun(
        f"zaya-{uuid.uuid4().hex[:8]}", sys.executable, "-m", "zaya_jax.cli", *_train_args(run, STEPS)
    )
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return run


def test_srun_launches_two_tasks_on_one_mesh_through_slurm_detection(uninterrupted):
    (start,) = [e["detail"] for e in _events(uninterrupted) if e["event"] == "start"]
    assert start["devices"] == 8 and start["processes"] == 2
    assert start["mesh"] == {"data": 2, "fsdp": 2, "expert": 2, "context": 1}
    final = uninterrupted / "checkpoints" / str(STEPS)
    assert {p.name for p in (final / "data").glob("process_*")} == {
        "process_0-of-2.json",
        "process_1-of-2.json",
    }
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (final / "params").iterdir()}


def _losses(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def test_scancel_stops_both_tasks_at_the_same_step_and_one_task_resumes_on_the_same_rows(
    tmp_path, uninterrupted
):
    run, name = tmp_path / "run", f"zaya-{uuid.uuid4().hex[:8]}"
    cmd = _srun(name, *faults.command("pause_at_step=1"), *_train_args(run, STEPS))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env()
    )
    try:
        for process in (0, 1):  # both tasks hold after step 1, so the signal lands there
            faults.wait_for_file(faults.paused_marker(run, 1, process), [proc])
        job = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True)
        assert job.stdout.strip(), job.stderr
        subprocess.run(["scancel", "--signal=TERM", job.stdout.split()[0]], check=True, timeout=60)
        for process in (0, 1):
            faults.wait_for_file(faults.signalled_marker(run, 1, process), [proc])
        faults.release(run, 1)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    stops = [(e["step"], e["detail"]) for e in _events(run) if e["event"] == "stop"]
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert stops == [(saved[-1], {"signal": "SIGTERM", "received_by": [0, 1]})], (stops, saved)
    stopped = saved[-1]
    # the step after the signal, saved by both tasks (step 2 was already dispatched when step 1's
    # hooks paused: dispatch ahead; the agreement at step 2 stops there, step by step too)
    assert stopped == 2
    assert {p.name for p in (run / "checkpoints" / str(stopped) / "data").iterdir()} >= {
        "process_0-of-2.json",
        "process_1-of-2.json",
    }

    # Elastic data: the job continues as one task of 8 devices (the same mesh) and trains on the
    # rows the uninterrupted 2-task job saw, so every later loss agrees with it to rounding (a
    # different row moves the loss by ~1e-2).
    env = _env()
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    cmd = [
        "srun",
        "-n",
        "1",
        f"--job-name={name}-1",
        sys.executable,
        "-m",
        "zaya_jax.cli",
        *_train_args(run, STEPS),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    starts = [e["detail"] for e in _events(run) if e["event"] == "start"]
    assert [(s["processes"], s["devices"]) for s in starts] == [(2, 8), (1, 8)]
    assert [e["detail"]["from_step"] for e in _events(run) if e["event"] == "resume"] == [stopped]
    ours, reference = _losses(run), _losses(uninterrupted)
    assert sorted(ours) == sorted(reference) == list(range(1, STEPS + 1))
    for step in ours:
        assert ours[step] == pytest.approx(reference[step], rel=1e-5), (step, ours, reference)


def test_zaya_supervise_under_srun_restarts_crashed_tasks_that_meet_again(tmp_path):
    run = tmp_path / "run"
    child = [*faults.command("crash_at_step=3"), *_train_args(run, 5)]
    supervise = [sys.executable, "-m", "zaya_jax.cli", "supervise", "--max-restarts", "3", "--backoff", "1"]
    cmd = _srun(f"zaya-{uuid.uuid4().hex[:8]}", *supervise, "--", *child)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    events = _events(run)
    failed = [e["detail"]["cause"] for e in events if e["event"] == "child_failed"]
    # both tasks' trainers crash at step 3; one may first abort as its peer's death reaches it
    assert len(failed) == 2 and "killed by SIGKILL" in failed, failed
    assert set(failed) <= {"killed by SIGKILL", "killed by SIGABRT"}, failed
    assert [e["event"] for e in events].count("restart") == 2
    assert [e["detail"]["from_step"] for e in events if e["event"] == "resume"] == [2]
    (end,) = [e["detail"] for e in events if e["event"] == "end"]
    assert end["steps"] == 5 and not end["interrupted"]


def test_srun_prepares_data_on_two_tasks_into_the_bytes_of_one(tmp_path):
    rows = [f"row {i}: " + "lorem ipsum " * (i % 11) for i in range(300)]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    command = [
        sys.executable,
        "-m",
        "zaya_jax.cli",
        "data",
        "prepare",
        str(jsonl),
        "--shards",
        "3",
        "--unit-mb",
    ]
    command.append(str(4096 / 2**20))  # 6 units of 4 KB
    outputs = {}
    for tasks in ("1", "2"):
        out = tmp_path / f"tasks{tasks}"
        cmd = ["srun", "-n", tasks, f"--job-name=prep-{uuid.uuid4().hex[:8]}", *command, "--out", str(out)]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        outputs[tasks] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        if (
            tasks == "2"
        ):  # the step's tasks split the units (SLURM_NTASKS / SLURM_PROCID), task 0 wrote the shards
            assert "host 1: 3/3 units" in result.stderr and "host 0: 6/6 units of all hosts" in result.stderr
    assert outputs["1"] == outputs["2"] and "manifest.json" in outputs["2"]
