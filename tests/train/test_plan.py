"""Compile-only planning: ``zaya train --compile-only --devices N`` compiles the step for a mesh of
N fake devices without allocating the model and reports per-device memory and GEMM-tile warnings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from zaya_jax.config import load_config
from zaya_jax.train.plan import gemm_tile_warnings


def _plan(*overrides: str, target: str | None = None) -> dict:
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
        *(["--target", target] if target else []),
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


def test_the_plan_is_the_gpu_program_not_the_cpu_one():
    """Planning on fake CPU devices traces the GPU branch of every platform-dependent op (the
    grouped GEMM and the ragged expert exchange, through their memory twins), never the CPU-only
    blocked grouped matmul or padded exchange, unless the CPU program is asked for."""
    gpu, _ = _plan("mesh.data=2", "mesh.expert=4")
    assert gpu["planned_program"] == "gpu"
    assert set(gpu["platform_paths"]) == {"ragged_dot_gpu_twin", "ragged_all_to_all_gpu_twin"}
    cpu, _ = _plan("mesh.data=2", "mesh.expert=4", target="cpu")
    assert cpu["planned_program"] == "cpu"
    assert set(cpu["platform_paths"]) == {"blocked_grouped_matmul"}
