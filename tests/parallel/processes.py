"""The multi-process runs of tests/parallel/test_multiprocess.py, test_multiprocess_grpo.py and
test_slurm.py: the miniature model on one data 2 x fsdp 2 x expert 2 mesh of 8 CPU devices, started
as two local processes (jax.distributed, 4 devices each) or as one process with all 8, and the GRPO
settings and loss comparison of the GRPO runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.fixtures import GRPO_SETTINGS, MINI
from tests.resilience import faults


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed(port: int, process_id: int) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id)]


def two_process_args(run: Path, steps: int) -> list[str]:
    """``zaya train`` arguments of the two-process runs: the miniature model on one data 2 x
    fsdp 2 x expert 2 mesh of 8 devices, a checkpoint every 2 steps."""
    return [
        *MINI,
        f"run.dir={run}",
        f"train.steps={steps}",
        "train.batch_size=8",
        "eval.every=100",
        "log.every=1",
        "checkpoint.every_steps=2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.expert=2",
    ]


def start_two_processes(
    run: Path, steps: int, *extra: str, clock_skew: float = 0.0, fault: tuple[str, ...] = ()
) -> list[subprocess.Popen]:
    """The two processes of a run (4 CPU devices each), with ``extra`` overrides; ``fault`` and
    ``clock_skew`` go to tests/resilience/faults.py's command."""
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    args = [*two_process_args(run, steps), *extra]
    return [
        subprocess.Popen(
            [
                *faults.command(*fault, clock_skew=clock_skew),
                "train",
                *args,
                "--no-progress",
                *_distributed(port, i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]


def finish(procs: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    """Wait for each process (10 min at most); each must exit 0."""
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
    return results


# GRPO on the runs above (whose batches of 8 rows and log lines every step it repeats), 2 steps per
# rollout: the second is off-policy, a loss that is not ~0
GRPO = [*GRPO_SETTINGS, "rl.steps_per_rollout=2", "train.dispatch_ahead=false"]


def one_process(
    run: Path, steps: int, *extra: str, fault: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """The same run in one process on 8 CPU devices (the same mesh shape)."""
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    result = subprocess.run(
        [*faults.command(*fault), "train", *two_process_args(run, steps), *GRPO, *extra, "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def train_metrics(run: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines if "loss" in line}


def assert_same_training(ours: dict[int, dict], theirs: dict[int, dict], steps: list[int]) -> None:
    """Losses and gradient norms to 1e-5 relative, the rollouts' rewards and lengths exactly. A
    GRPO loss is a sum of O(1) terms that cancel (advantages sum to 0 in every group; on policy the
    ratio is 1 and the loss 0 up to rounding), so where it is near 0 it is held to 1e-7 absolute."""
    assert sorted(ours) == sorted(theirs) == steps
    for s in steps:
        assert (
            ours[s]["reward"] == theirs[s]["reward"]
            and ours[s]["completion_length"] == theirs[s]["completion_length"]
        )
        assert ours[s]["loss"] == pytest.approx(theirs[s]["loss"], rel=1e-5, abs=1e-7), s
        assert ours[s]["grad_norm"] == pytest.approx(theirs[s]["grad_norm"], rel=1e-5), s
    off_policy = [s for s in steps if abs(theirs[s]["loss"]) > 1e-5]
    assert off_policy, "no step with a loss to compare relatively"
    gaps = {s: abs(ours[s]["loss"] / theirs[s]["loss"] - 1) for s in off_policy}
    worst = max(abs(ours[s]["loss"] - theirs[s]["loss"]) for s in steps)
    print(f"relative loss gaps where the loss is not ~0: {gaps}; largest absolute gap {worst:.3g}")
