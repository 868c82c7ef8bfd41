"""Compile-only planning: ``zaya train --compile-only --devices N`` compiles the step for a mesh of
N fake devices without allocating the model and reports per-device memory and GEMM-tile warnings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from zaya_jax.config import load_config
from zaya_jax.parallel.plan import gemm_tile_warnings


def _plan(*overrides: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    cmd = [
        sys.executable,
        "-m",
        "zaya_jax.cli",
        "train",
        "--config",
        "tiny",
        "--compile-only",
        "--devices",
        "8",
    ]
    result = subprocess.run([*cmd, *overrides], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{") :]), result.stderr


def test_compile_only_reports_per_device_memory_for_the_target_mesh(tmp_path):
    fsdp, stderr = _plan("mesh.data=1", "mesh.fsdp=8", f"run.dir={tmp_path / 'run'}")
    assert fsdp["devices"] == 8 and fsdp["mesh"]["fsdp"] == 8
    # Unsplit, the state is at least the float32 parameters plus one float32 moment each; FSDP
    # splits nearly all of it 8 ways.
    whole = 2 * 4 * fsdp["total_params"]
    assert fsdp["state_bytes_per_device"] < whole / 4
    assert fsdp["argument_bytes_per_device"] >= fsdp["state_bytes_per_device"]
    assert fsdp["peak_bytes_per_device"] > fsdp["argument_bytes_per_device"]
    assert "vocab_size=264 is not a multiple of 64" in stderr
    assert not (tmp_path / "run").exists()  # planning writes no run directory


def test_gemm_tile_warnings_name_the_unfriendly_dimensions():
    cfg = load_config("zaya1-8b")
    assert gemm_tile_warnings(cfg) == []  # the published model is tile-friendly
    odd = load_config("zaya1-8b", overrides=["model.moe_intermediate_size=4032"])
    assert gemm_tile_warnings(odd) == ["model.moe_intermediate_size=4032 is a multiple of 64 but not of 128"]
