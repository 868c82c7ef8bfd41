"""The dropless MoE's grouped matmul on CPU as XLA FFI custom calls
(``custom_calls/cpu/grouped_matmul_cpu.cc``): ``jax.lax.ragged_dot``'s contract (rows sorted by
group, each group against its own weight matrix, rows past ``sum(group_sizes)`` zero), forward and
both gradients, one GEMM per group over exactly its rows, threaded over (group, 32-row tile) on
XLA's intra-op pool.

Why a custom call: XLA:CPU has no grouped GEMM. It expands ``ragged_dot`` into a dense product per
group (G times the work), and :func:`zaya_jax.model.experts.blocked_grouped_matmul` (the reference
and the fallback) pads each group to 128-row blocks and runs one batched matmul with a copy of the
weights per block, whose 128-row products XLA:CPU runs at ~40% of the machine's matmul peak
(``bench/RESULTS.md``, issue 41). float32 only; the caller keeps the blocked form for other dtypes
and where the library is not built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.ops._registry import registered_target
from zaya_jax.ops.manual_axes import typed_like_reference

FORWARD, WEIGHT_GRAD = "zaya_grouped_matmul", "zaya_grouped_matmul_dw"


def available() -> bool:
    """Whether both custom calls are registered (the CPU library is built and loads)."""
    return registered_target("cpu", FORWARD) and registered_target("cpu", WEIGHT_GRAD)


def _product(x, w, group_sizes, transpose_w: bool):
    rows, n = x.shape[0], w.shape[1] if transpose_w else w.shape[2]
    call = jax.ffi.ffi_call(FORWARD, jax.ShapeDtypeStruct((rows, n), jnp.float32), vmap_method="sequential")
    return call(x, w, group_sizes, transpose_w=transpose_w)


def _weight_grad(x, dy, group_sizes, shape):
    call = jax.ffi.ffi_call(WEIGHT_GRAD, jax.ShapeDtypeStruct(shape, jnp.float32), vmap_method="sequential")
    return call(x, dy, group_sizes)


# Inside shard_map (expert parallelism) the results get ragged_dot's varying-axes types, and the
# gradient of a weight replicated over an axis the rows vary over is summed over it.
_typed_forward = typed_like_reference(lambda x, w, group_sizes: (_product(x, w, group_sizes, False),))
_typed_backward = typed_like_reference(
    lambda x, w, group_sizes, dy: (
        _product(dy, w, group_sizes, True),  # rows past the groups: 0, as their outputs are
        _weight_grad(x, dy, group_sizes, w.shape),
    ),
    like=(0, 1),
)


@jax.custom_vjp
def _grouped(x, w, group_sizes):
    return _typed_forward(x, w, group_sizes)[0]


def _grouped_forward(x, w, group_sizes):
    return _typed_forward(x, w, group_sizes)[0], (x, w, group_sizes)


def _grouped_backward(residuals, dy):
    x, w, group_sizes = residuals
    dx, dw = _typed_backward(x, w, group_sizes, dy)
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_grouped.defvjp(_grouped_forward, _grouped_backward)


def cpu_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` by the custom call: x (rows, K) float32 sorted by
    group, w (G, K, N) float32, group_sizes (G,) integer (negative sizes count as 0; rows past
    ``rows`` are cut). Differentiable in x and w. Runs on a CPU only; the MoE layer falls back to
    the blocked form where this is not :func:`available` or the operands are not float32."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise TypeError(f"cpu_grouped_matmul takes float32 operands, got {x.dtype} and {w.dtype}")
    if not available():  # also registers the targets on first use
        raise RuntimeError(
            "the CPU kernel library lacks zaya_grouped_matmul: rebuild with python custom_calls/build.py"
        )
    return _grouped(x, w, group_sizes.astype(jnp.int32))
