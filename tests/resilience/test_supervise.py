"""``zaya supervise`` and unhealthy nodes, with a child that writes a drain record and exits as the
trainer does (76 drained, 77 stopped): the exclusion list with reasons, giving up on an excluded
node, restarting on a healthy one, and (under the CI's one-node Slurm cluster) the job requeued
with the node in its ``ExcNodeList``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from zaya_jax.resilience.health import EXIT_DRAIN, EXIT_UNHEALTHY, node_name
from zaya_jax.resilience.supervise import EXCLUDED, Supervisor, excluded_nodes

# The child: on its first attempt, a drain record naming node argv[2] and exit argv[3]; then exit 0.
CHILD = """
import json, sys, time
from pathlib import Path
run, node, code = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
marker = run / "attempted"
if marker.exists():
    sys.exit(0)
marker.write_text("1")
finding = {"probe": "gpu", "status": "fail", "message": "GPU 1: 2 uncorrectable ECC errors", "node": node, "detail": {}}
record = {"time": time.time(), "step": 3, "found_at_step": 3, "at": "step", "policy": "drain", "findings": [finding]}
(run / "drain.json").write_text(json.dumps(record))
sys.exit(code)
"""


def _supervise(run: Path, node: str, code: int) -> int:
    child = [sys.executable, "-c", CHILD, str(run), node, str(code)]
    return Supervisor(child, run, backoff_s=0.01, poll_s=0.01).run()


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


@pytest.fixture
def no_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def test_a_drained_node_is_excluded_and_its_supervisor_gives_up(tmp_path, no_slurm):
    assert _supervise(tmp_path, node_name(), EXIT_DRAIN) == EXIT_DRAIN
    (entry,) = excluded_nodes(tmp_path)
    assert entry["node"] == node_name() and entry["step"] == 3
    assert entry["reason"] == "gpu probe: GPU 1: 2 uncorrectable ECC errors"
    names = [e["event"] for e in _events(tmp_path)]
    assert names == ["child_start", "child_failed", "node_excluded", "give_up"]
    assert "this node" in _events(tmp_path)[-1]["detail"]["reason"]


def test_a_healthy_host_restarts_its_trainer_after_another_node_drained(tmp_path, no_slurm):
    assert _supervise(tmp_path, "node-17", EXIT_DRAIN) == 0
    assert [e["node"] for e in excluded_nodes(tmp_path)] == ["node-17"]
    names = [e["event"] for e in _events(tmp_path)]
    assert names == ["child_start", "child_failed", "node_excluded", "restart", "child_start", "child_exit"]
    # a second drain naming the same node does not list it twice
    (tmp_path / "attempted").unlink()
    assert _supervise(tmp_path, "node-17", EXIT_DRAIN) == 0
    assert len(json.loads((tmp_path / EXCLUDED).read_text())) == 1


def test_an_unhealthy_stop_gives_up(tmp_path, no_slurm):
    assert _supervise(tmp_path, "node-3", EXIT_UNHEALTHY) == EXIT_UNHEALTHY
    assert _events(tmp_path)[-1]["event"] == "give_up"
    assert "resilience.on_unhealthy=stop" in _events(tmp_path)[-1]["detail"]["reason"]


def _slurm_up() -> bool:
    if shutil.which("sbatch") is None:
        return False
    state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return state.returncode == 0 and any(s in state.stdout for s in ("idle", "mixed", "allocated"))


@pytest.mark.skipif(not _slurm_up(), reason="no Slurm node is up (tests/slurm/cluster.sh starts one as root)")
def test_slurm_requeues_the_job_without_the_drained_node(tmp_path):
    """The job's only node drains: the job is requeued (Restarts=1) with that node excluded, and
    so stays pending; the test cancels it."""
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "child.py").write_text(CHILD)
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"cd {Path(__file__).resolve().parents[2]}\n"
        f"{sys.executable} -m zaya_jax.cli supervise --backoff 0.1 --run-dir {run} -- "
        f'{sys.executable} {tmp_path / "child.py"} {run} "$SLURMD_NODENAME" {EXIT_DRAIN}\n'
    )
    name = f"zaya-drain-{uuid.uuid4().hex[:8]}"
    job = subprocess.run(
        ["sbatch", "--parsable", "--requeue", f"--job-name={name}", f"--output={tmp_path}/job-%j.out", str(script)],
        capture_output=True, text=True, timeout=60, check=True, env={**os.environ, "PYTHONPATH": ""},
    ).stdout.strip().split(";")[0]  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
            if "Restarts=1" in shown and "JobState=PENDING" in shown and "Reason=job_requeued" not in shown:
                break
            if any(f"JobState={s}" in shown for s in ("COMPLETED", "FAILED", "CANCELLED")):
                break  # ended without a requeue: the assertions below say how
            time.sleep(0.5)
        node = excluded_nodes(run)[0]["node"]
        assert f"ExcNodeList={node}" in shown and "Restarts=1" in shown and "JobState=PENDING" in shown, shown
        assert "requeue" in [e["event"] for e in _events(run)]
    finally:
        subprocess.run(["scancel", job], timeout=60)


class _Exited(Exception):
    pass


@pytest.mark.parametrize("policy, code", [("drain", 75), ("stop", EXIT_UNHEALTHY), ("warn", None)])
def test_a_step_stuck_past_the_collective_timeout_is_classified_and_acted_on(tmp_path, policy, code):
    from zaya_jax.resilience.watchdog import HANG_STACKS, Watchdog

    exits = []

    def exit_(status):
        exits.append(status)
        raise _Exited

    dog = Watchdog(tmp_path, 0.0, collective_timeout_s=5.0, on_collective_timeout=policy, exit=exit_)
    try:
        dog.beat(3, "compile")
        dog.check(60.0)  # compiling: not a collective
        dog.beat(3)
        dog.check(4.0)  # within the limit
        assert exits == [] and not (tmp_path / HANG_STACKS).exists()
        with contextlib.suppress(_Exited):
            dog.check(6.0)
        dog.check(7.0)  # warn: reported once per stuck step
    finally:
        dog.close()
    assert exits == ([] if code is None else [code])
    events = [e for e in _events(tmp_path) if e["event"] == "collective_timeout"]
    assert len(events) == 1 and events[0]["step"] == 3 and events[0]["detail"]["action"] == policy
    assert "collective_timeout: step 4 has waited 6 s" in (tmp_path / HANG_STACKS).read_text()
