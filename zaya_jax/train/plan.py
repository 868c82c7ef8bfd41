"""Compile-only planning: lower and compile the training step for a target mesh without allocating
a single array (abstract inputs carrying their shardings), and report per-device memory as XLA
plans it, plus the model dimensions that fit AMD MI300X GEMM tiles poorly.

``zaya train --config zaya1-8b --compile-only --devices 64 mesh.fsdp=8 mesh.expert=8`` runs this on
64 fake CPU devices. The program is built by :func:`zaya_jax.programs.build_programs`, as training
builds it (all four inputs of the step, its loss guard included). The program traced is the GPU's (``target="gpu"``, the default): every
platform-dependent op takes its GPU branch, with a memory twin where XLA:CPU cannot compile the GPU
op as a GPU does (``zaya_jax.ops.platform``); the report names the twins. XLA:CPU's buffer
assignment still approximates, not equals, the GPU compiler's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import Config
from zaya_jax.model import param_counts
from zaya_jax.objectives import build_programs, check
from zaya_jax.ops.platform import Target, planning_for
from zaya_jax.parallel.distributed import apply_runtime
from zaya_jax.programs import TrainState, fingerprint
from zaya_jax.train.fit import peak_bytes
from zaya_jax.train.schedule import largest_step


def gemm_tile_warnings(cfg: Config, tile: int = 64, preferred: int = 128) -> list[str]:
    """Matmul dimensions that are not multiples of ``tile`` (or of ``preferred``): MI300X's GEMM
    kernels use 64- and 128-wide tiles, so such sizes waste a partial tile per matmul."""
    m = cfg.model
    dims = {
        "model.hidden_size": m.hidden_size,
        "model.moe_intermediate_size": m.moe_intermediate_size,
        "query width (num_heads x head_dim)": m.q_width,
        "key/value width (num_kv_heads x head_dim)": m.kv_width,
        "model.router_hidden_size": m.router_hidden_size,
        "model.vocab_size": m.vocab_size,
        "tokens per micro-batch": cfg.train.batch_size // cfg.train.micro_batches * cfg.train.seq_len,
    }
    warnings = []
    for name, size in dims.items():
        if size % tile:
            warnings.append(f"{name}={size} is not a multiple of {tile}")
        elif size % preferred:
            warnings.append(f"{name}={size} is a multiple of {tile} but not of {preferred}")
    return warnings


# Named scopes of the platform-specific code paths, as they appear in the compiled program.
PLATFORM_PATHS = {
    "ragged_dot_gpu_twin": "gpu: grouped GEMM (ragged_dot), planned with its memory twin",
    "ragged_all_to_all_gpu_twin": "gpu: ragged expert exchange, planned with its memory twin",
    "grouped_matmul_cpu": "cpu: grouped GEMM custom call",
    "blocked_grouped_matmul": "cpu: blocked grouped matmul",
}


def compile_plan(cfg: Config, target: Target = "gpu", gpu_kind: str | None = None) -> dict[str, Any]:
    """Lower and compile the run's largest train step (the one ``zaya train`` compiles first: the
    final batch at the longest rows, with that stage's model) on the current devices (usually fake
    CPU devices), tracing ``target``'s program ("gpu" or "cpu"). Where ``target`` is the backend's own platform, the
    program is exactly the one ``zaya train`` compiles for the same config and layout: the report's
    ``train_step_fingerprint`` equals the ``compiled`` event's in the run's ``events.jsonl``.
    ``gpu_kind`` (e.g. "H200"): plan the MoE path ``moe_impl: auto`` chose on that GPU (its cached
    measurement), reported under ``moe_impl``."""
    check(cfg)
    apply_runtime(cfg.runtime)
    native = (target == "cpu") == (jax.default_backend() == "cpu")
    with contextlib.nullcontext() if native else planning_for(target, gpu_kind):
        rows, seq, stage = largest_step(cfg)  # the step training compiles first (its fit check)
        programs = build_programs(cfg).at_stage(stage)
        lowered = programs.lower_train_step(rows, seq)
        compiled = lowered.compile()
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()

    def per_device(tree: TrainState) -> int:
        total = 0
        for leaf in jax.tree.leaves(tree):
            shard = leaf.sharding.shard_shape(leaf.shape)
            total += int(np.prod(shard)) * jnp.dtype(leaf.dtype).itemsize
        return total

    report = {
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "planned_program": target,
        "train_step_fingerprint": fingerprint(lowered),
        "batch": [rows, seq],
        **({"stage": stage} if cfg.train.stages else {}),
        "platform_paths": {name: about for name, about in PLATFORM_PATHS.items() if name in hlo},
        "moe_impl": programs.moe.record() if programs.moe is not None else None,
        "mesh": dict(programs.layout.mesh.shape),
        **param_counts(cfg.model),
        "state_bytes_per_device": per_device(programs.abstract_state),
        "gemm_tile_warnings": gemm_tile_warnings(cfg),
    }
    if memory is not None:
        report.update(
            {
                "argument_bytes_per_device": int(memory.argument_size_in_bytes),
                "output_bytes_per_device": int(memory.output_size_in_bytes),
                "temp_bytes_per_device": int(memory.temp_size_in_bytes),
                "peak_bytes_per_device": peak_bytes(memory),
            }
        )
    return report
