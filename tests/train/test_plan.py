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
    grouped GEMM custom call or padded exchange, unless the CPU program is asked for."""
    gpu, _ = _plan("mesh.data=2", "mesh.expert=4")
    assert gpu["planned_program"] == "gpu"
    assert set(gpu["platform_paths"]) == {"ragged_dot_gpu_twin", "ragged_all_to_all_gpu_twin"}
    cpu, _ = _plan("mesh.data=2", "mesh.expert=4", target="cpu")
    assert cpu["planned_program"] == "cpu"
    assert set(cpu["platform_paths"]) == {"grouped_matmul_cpu"}


def test_the_planned_step_is_the_trained_step(tmp_path):
    """``--compile-only`` and ``zaya train`` build the step in one place (``build_programs``): on
    the same config and mesh the plan's fingerprint is the one the run records when it compiles.
    (That the fingerprint tells programs apart: the next test.)"""
    from tests.fixtures import MINI

    # train.steps is in the program too: the learning-rate schedule's constants
    layout = ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", "train.batch_size=8", "train.steps=1"]
    run = tmp_path / "run"
    env = {
        **{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"},
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
    }
    cmd = [sys.executable, "-m", "zaya_jax.cli", "train", *MINI, *layout, f"run.dir={run}"]
    result = subprocess.run([*cmd, "--no-progress"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (compiled,) = [e["detail"] for e in events if e["event"] == "compiled"]
    assert compiled["program"] == "train_step" and compiled["batch"] == [8, 32]

    planned, _ = _plan(*MINI, *layout, target="cpu")
    assert planned["mesh"] == {"data": 2, "fsdp": 2, "expert": 2, "context": 1}
    assert planned["train_step_fingerprint"] == compiled["fingerprint"]


def test_a_step_without_the_loss_guard_is_another_program():
    """The fingerprint tells the trained step (four inputs, the accept/reject select over the
    state) from the three-input step the plan used to build for itself."""
    import jax

    from zaya_jax.objectives import build_programs
    from zaya_jax.optim import set_lr_scale
    from zaya_jax.programs import fingerprint, make_train_step

    cfg = load_config("tiny", ["train.batch_size=2", "train.seq_len=32"])
    programs = build_programs(cfg)
    layout = programs.layout
    three_inputs = jax.jit(
        make_train_step(cfg, programs.tx, set_lr_scale, objective=programs.bound, **layout.step_hooks),
        in_shardings=(programs.shardings, layout.batch, layout.replicated),
        out_shardings=(programs.shardings, layout.replicated),
        donate_argnums=0,
    )
    scalar = jax.ShapeDtypeStruct((), "float32", sharding=layout.replicated)
    old = three_inputs.lower(programs.abstract_state, programs.abstract_batch(), scalar)
    assert fingerprint(old) != fingerprint(programs.lower_train_step())
    assert fingerprint(programs.lower_train_step()) == fingerprint(programs.lower_train_step())
