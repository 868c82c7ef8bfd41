"""Fit before running: every preset's plan leaves >= 20% of the device it names; a step that will
not fit stops before the first step with one line naming the need, the capacity and compiled
settings that fit; an allocation failure at run time is one line, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from tests.fixtures import MINI
from zaya_jax.cli import main
from zaya_jax.config import load_config
from zaya_jax.train.fit import DEVICE_MEMORY_GB, OutOfMemoryError
from zaya_jax.train.hooks import Hook


def _plan(config: str, *overrides: str, devices: int = 1, fit: str | None = None) -> tuple[int, dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    cmd = [sys.executable, "-m", "zaya_jax.cli", "train", "--config", config, "--compile-only",
           "--devices", str(devices), *(["--fit-device", fit] if fit else []), *overrides]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    report = json.loads(proc.stdout[proc.stdout.index("{") :]) if "{" in proc.stdout else {}
    return proc.returncode, report, proc.stderr


def test_small_fits_one_h200_and_one_mi300x_with_headroom():
    code, report, stderr = _plan("small", fit="h200")
    assert code == 0, stderr[-2000:]
    assert report["planned_program"] == "gpu" and report["fit"]["headroom"] >= 0.2, report["fit"]
    peak = report["peak_bytes_per_device"]
    assert peak <= 0.8 * DEVICE_MEMORY_GB["mi300x"] * 1e9
    # the preset's second micro-batch is what makes it fit: one micro-batch plans ~97% of an H200
    assert load_config("small").train.micro_batches == 2


def test_zaya1_8b_fits_64_mi300x_as_its_launch_file_runs_it():
    code, report, stderr = _plan(
        "zaya1-8b",
        "mesh.optimizer_sharding=zero1",
        "mesh.data=64",
        "train.micro_batches=4",
        devices=64,
        fit="mi300x",
    )
    assert code == 0, stderr[-2000:]
    assert report["devices"] == 64 and report["fit"]["headroom"] >= 0.2, report["fit"]


def test_a_plan_over_the_device_exits_1_naming_the_fix():
    code, report, stderr = _plan(
        "tiny", "train.batch_size=256", "train.seq_len=4096", "model.max_position_embeddings=4096", fit="h100"
    )
    assert report["fit"]["headroom"] < 0 and code == 1
    assert "raise train.micro_batches" in stderr


def _peak(*overrides: str) -> int:
    """The run's own step planned in this process (the CPU program, as this test trains it)."""
    from zaya_jax.train.plan import compile_plan

    return compile_plan(load_config("tiny", overrides=[*MINI, *overrides]), "cpu")["peak_bytes_per_device"]


def test_a_step_that_will_not_fit_stops_before_the_first_step_with_settings_that_fit(tmp_path, capsys):
    shape = ["train.batch_size=8", "train.seq_len=256"]
    one, four = _peak(*shape), _peak(*shape, "train.micro_batches=4")
    assert four < one
    limit = f"runtime.memory_limit_gb={(one + four) / 2 / 1e9:.6f}"
    run = tmp_path / "run"
    code = main(["train", *MINI, *shape, limit, f"run.dir={run}", "train.steps=2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    line = next(line for line in err.splitlines() if "plans" in line)
    assert "Traceback" not in err and "runtime.memory_limit_gb" in line and "settings that fit" in line
    micro = int(re.search(r"train\.micro_batches=(\d+)", line).group(1))
    assert micro in (2, 4)
    assert not list(run.glob("checkpoints/*"))  # stopped before any step
    assert not [t for t in threading.enumerate() if t.name == "zaya-watchdog"]  # the stopped run's is closed
    # the named setting does fit: the same run with it trains
    code = main(["train", *MINI, *shape, limit, f"train.micro_batches={micro}", f"run.dir={tmp_path / 'ok'}",
                 "train.steps=2", "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err


class _OutOfMemoryAt(Hook):
    def __init__(self, step: int):
        self.step = step

    def before_step(self, step, batch):
        if step == self.step:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory allocating 248708314152 bytes."
            )
        return batch


def test_out_of_memory_at_run_time_is_one_line_and_keeps_the_saved_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", *MINI, f"run.dir={run}", "train.steps=4", "checkpoint.every_steps=2", "--no-progress"]
    assert main(args, hooks=[_OutOfMemoryAt(3)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(line for line in err.splitlines() if "out of device memory" in line)
    assert "RESOURCE_EXHAUSTED" in line and "train.micro_batches" in line
    assert main(args) == 0  # resumes from the step-2 checkpoint
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 4 and np.isfinite(summary["final_loss"])


def test_an_allocation_failure_in_the_step_names_the_runs_settings():
    from zaya_jax.train.compiled import TrainStep

    class Programs:
        cfg = load_config("tiny", overrides=["train.micro_batches=2", "train.batch_size=8"])

        def step_arguments(self, *args):
            return args

        def at_stage(self, stage):
            return self

    def failing(*args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.1GiB")

    programs = Programs()
    step = TrainStep(programs, watchdog=None, event=None)
    step._compiled[(id(programs), 8, 32)] = failing
    with pytest.raises(OutOfMemoryError, match=r"train\.micro_batches=2.*9\.1GiB"):
        step(1, None, {"inputs": np.zeros((8, 32))}, 1.0, np.inf)


@pytest.mark.parametrize(
    ("config", "overrides"),
    [("zaya1-8b", []), ("tiny", [*MINI, "runtime.memory_limit_gb=0.0001"])],
)
def test_a_state_too_big_for_the_machine_stops_in_one_line_before_anything_is_built(
    tmp_path, capsys, config, overrides
):
    """ZAYA1-8B's state (73 GB on one device) on a host with less RAM, and a tiny model under a
    tiny memory limit: one line naming the need and the capacity, before any MoE timing, compile
    or allocation, and no run directory written."""
    from zaya_jax.programs.memory import available_host_bytes

    if not overrides and (available_host_bytes() or 0) > 73e9:
        pytest.skip("this host has the RAM for ZAYA1-8B's state")
    run = tmp_path / "run"
    assert main(["train", config, *overrides, f"run.dir={run}", "--no-progress"]) == 1
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "the train state alone" in line)
    assert "per device and the device has" in line and "mesh.fsdp" in line
    assert "compiling" not in err and "Traceback" not in err and not run.exists()
