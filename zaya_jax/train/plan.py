"""Compile-only planning: lower and compile the training step for a target mesh without allocating
a single array (abstract inputs carrying their shardings), and report per-device memory as XLA
plans it, plus the model dimensions that fit AMD MI300X GEMM tiles poorly.

``zaya train --config zaya1-8b --compile-only --devices 64 mesh.fsdp=8 mesh.expert=8`` runs this on
64 fake CPU devices. The program traced is the GPU's (``target="gpu"``, the default): every
platform-dependent op takes its GPU branch, with a memory twin where XLA:CPU cannot compile the GPU
op as a GPU does (``zaya_jax.ops.platform``); the report names the twins. XLA:CPU's buffer
assignment still approximates, not equals, the GPU compiler's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import Config
from zaya_jax.data import BATCH_FIELDS
from zaya_jax.model import init_variables, param_counts
from zaya_jax.ops.platform import Target, planning_for
from zaya_jax.optim import build_optimizer, model_param_groups, set_lr_scale
from zaya_jax.parallel import make_layout
from zaya_jax.train.step import init_train_state, make_train_step


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
    "blocked_grouped_matmul": "cpu: blocked grouped matmul",
}


def compile_plan(cfg: Config, target: Target = "gpu") -> dict[str, Any]:
    """Lower and compile the train step on the current devices (usually fake CPU devices), tracing
    ``target``'s program ("gpu" or "cpu")."""
    with planning_for(target):
        return _compile_plan(cfg, target)


def _compile_plan(cfg: Config, target: Target) -> dict[str, Any]:
    layout = make_layout(cfg)
    groups = model_param_groups(cfg.model, cfg.optim.router_group)
    tx = build_optimizer(cfg.optim, groups, cfg.train.steps, shardings=layout.variables["params"])

    abstract = jax.eval_shape(
        lambda key: init_train_state(init_variables(cfg.model, key), tx), jax.random.key(0)
    )
    shardings = layout.state_shardings(abstract)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    rows, seq = cfg.train.batch_size, cfg.train.seq_len
    batch = {
        key: jax.ShapeDtypeStruct((rows, seq), dtype, sharding=layout.batch)
        for key, dtype in BATCH_FIELDS.items()
    }
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=layout.replicated)
    step = jax.jit(
        make_train_step(cfg, tx, set_lr_scale, **layout.step_hooks),
        in_shardings=(shardings, layout.batch, layout.replicated),
        out_shardings=(shardings, layout.replicated),
        donate_argnums=0,
    )
    compiled = step.lower(state, batch, lr).compile()
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()

    def per_device(tree: Any) -> int:
        total = 0
        for leaf in jax.tree.leaves(tree):
            shard = leaf.sharding.shard_shape(leaf.shape)
            total += int(np.prod(shard)) * jnp.dtype(leaf.dtype).itemsize
        return total

    report = {
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "planned_program": target,
        "platform_paths": {name: about for name, about in PLATFORM_PATHS.items() if name in hlo},
        "mesh": dict(layout.mesh.shape),
        **param_counts(cfg.model),
        "state_bytes_per_device": per_device(state),
        "gemm_tile_warnings": gemm_tile_warnings(cfg),
    }
    if memory is not None:
        report.update(
            {
                "argument_bytes_per_device": int(memory.argument_size_in_bytes),
                "output_bytes_per_device": int(memory.output_size_in_bytes),
                "temp_bytes_per_device": int(memory.temp_size_in_bytes),
                "peak_bytes_per_device": int(
                    memory.argument_size_in_bytes
                    + memory.temp_size_in_bytes
                    + memory.output_size_in_bytes
                    - memory.alias_size_in_bytes
                ),
            }
        )
    return report
