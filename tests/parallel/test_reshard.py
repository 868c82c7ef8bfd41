"""Resharding: a run checkpointed on 8 devices in ZeRO-1 (data=8, the optimizer state split over
data) resumes on 4 devices laid out as fsdp=2 x expert=2 (parameters, optimizer state and experts
split differently); training continues with the losses of an uninterrupted data=8 run (within the
cross-layout tolerance of test_layouts.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.fixtures import MINI
from tests.resilience import faults

COMMON = [
    *MINI,
    "train.batch_size=8",
    "log.every=1",
    "eval.every=100",
    "checkpoint.every_steps=2",
]


def _env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }


def _train(run: Path, devices: int, *extra: str) -> None:
    cmd = [sys.executable, "-m", "zaya_jax.cli", "train", *COMMON, f"run.dir={run}", *extra, "--no-progress"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(devices), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def _train_and_preempt_after_step_2(run: Path, devices: int, *extra: str) -> None:
    """The training command with ``extra``, preempted by a SIGTERM that lands after step 1: it
    saves step 2 and exits."""
    cmd = [*faults.command("pause_at_step=1"), "train", *COMMON, f"run.dir={run}", *extra, "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(devices))
    faults.signal_while_paused(run, 1, [proc], signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]


def _losses(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def _mesh(run: Path) -> list[dict[str, int]]:
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [e["detail"]["mesh"] for e in events if e["event"] == "start"]


def test_a_checkpoint_resumes_on_another_mesh_and_device_count(tmp_path):
    reference = tmp_path / "reference"
    _train(reference, 8, "train.steps=4", "mesh.data=8")

    run = tmp_path / "run"
    _train_and_preempt_after_step_2(run, 8, "train.steps=4", "mesh.data=8", "mesh.optimizer_sharding=zero1")
    assert sorted(_losses(run)) == [1, 2]
    _train(run, 4, "train.steps=4", "mesh.data=1", "mesh.fsdp=2", "mesh.expert=2")

    assert _mesh(run) == [
        {"data": 8, "fsdp": 1, "expert": 1, "context": 1},
        {"data": 1, "fsdp": 2, "expert": 2, "context": 1},
    ]
    got, want = _losses(run), _losses(reference)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [want[s] for s in range(1, 5)], rtol=1e-4)
