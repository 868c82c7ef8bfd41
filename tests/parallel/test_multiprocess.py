"""Two local processes x 4 CPU devices (jax.distributed, gloo collectives) train a miniature model
on one 8-device mesh, save a checkpoint (each process writing its own shards), and a second launch
restores it across both processes and continues; the result loads on this single device."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import zaya_jax
from tests.train.test_loop import MINI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed(port: int, process_id: int) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id)]


def _launch(run: Path, steps: int) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    args = [
        *MINI,
        f"run.dir={run}",
        f"train.steps={steps}",
        "train.batch_size=8",
        "train.eval_every=100",
        "train.log_every=1",
        "checkpoint.every_steps=2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.expert=2",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "zaya_jax.cli", "train", *args, "--no-progress", *_distributed(port, i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
    return results


def test_two_processes_train_save_and_resume_across_processes(tmp_path):
    run = tmp_path / "run"
    first = _launch(run, steps=4)
    summary = json.loads(first[0].stdout[first[0].stdout.index("{") :])
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 8 * 32  # global batch: 8 rows of 32
    start = json.loads((run / "events.jsonl").read_text().splitlines()[0])
    assert start["detail"]["devices"] == 8
    assert start["detail"]["mesh"] == {"data": 2, "fsdp": 2, "expert": 2, "context": 1}
    shards = {p.name for p in (run / "checkpoints" / "4" / "params").iterdir()}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards  # each process wrote its own shards

    _launch(run, steps=6)  # the same command with more steps: both processes restore step 4
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "loss" in line]
    assert steps == [1, 2, 3, 4, 5, 6]  # written once, by process 0 only
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["detail"]["from_step"] for e in events if e["event"] == "resume"] == [4]

    lm = zaya_jax.load(run)
    assert lm.step == 6
    assert np.isfinite(lm.logits([[5, 6, 7]])).all()
