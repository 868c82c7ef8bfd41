"""Batched float32 matrix products for Muon's Newton–Schulz iterations: ``a @ b`` (or ``a @ bᵀ``)
over matching leading axes; on CPU the GEMM custom call ``zaya_batched_matmul``
(``custom_calls/cpu/grouped_matmul_cpu.cc``, the grouped matmul's 8 x 32 register tile), elsewhere
``jnp.matmul``.

Why a custom call: XLA:CPU runs a batch of small products at about one core's matmul peak. On a
2-core 190 GFLOP/s machine, ``tiny``'s 16 x (128 x 128 @ 128 x 512), the iteration's
``(bG + cG²)X``: 88 GFLOP/s in XLA, 135 in the custom call (at 128 x 256: 97 and 161); ``G²`` at
128 x 128: 97 and 139. The custom call threads over (matrix, 32-row tile); its products accumulate
over the contraction in order with fused multiply-adds, as XLA:CPU's do, and gave the same bits on
those shapes (``tests/ops/test_batched_matmul.py`` holds them to float32 rounding). The whole
orthogonalisation of ``tiny``'s Muon leaves takes 0.79-0.85x the time it took with XLA's products
(``bench/RESULTS.md``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from zaya_jax.ops._registry import registered_target
from zaya_jax.ops.manual_axes import typed_like_reference
from zaya_jax.ops.platform import platform_branch

TARGET = "zaya_batched_matmul"


def available() -> bool:
    """Whether the custom call is registered (the CPU library is built and loads)."""
    return registered_target("cpu", TARGET)


def _reference(a, b, transpose_b):
    return a @ (jnp.swapaxes(b, -1, -2) if transpose_b else b)


def _call(a, b, transpose_b):
    n = b.shape[-2] if transpose_b else b.shape[-1]
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((*a.shape[:-1], n), jnp.float32), vmap_method="broadcast_all"
    )
    return call(a, b, transpose_b=transpose_b)


def _on_cpu(a, b, transpose_b):
    # typed like jnp.matmul inside shard_map (a custom call's results carry no varying axes)
    return typed_like_reference(lambda a, b: (_call(a, b, transpose_b),))(a, b)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(a, b, transpose_b):
    return platform_branch(
        a, b, cpu=lambda a, b: _on_cpu(a, b, transpose_b), gpu=lambda a, b: _reference(a, b, transpose_b)
    )


def _product_forward(a, b, transpose_b):
    return _product(a, b, transpose_b), (a, b)


def _product_backward(transpose_b, residuals, g):  # through jnp: Muon never differentiates this
    a, b = residuals
    _, vjp = jax.vjp(lambda a, b: _reference(a, b, transpose_b), a, b)
    return vjp(g)


_product.defvjp(_product_forward, _product_backward)


MIN_MACS = 1 << 24
"""Products with fewer multiply-adds in all stay with XLA (16M: a batch of 16 128 x 128 x 128 products
takes the custom call, a batch of 4 does not): in ``tiny``'s train step the custom call on a batch
of 4 took ~1 ms, 5x XLA's time, where alone it matched it."""


def matmul(a: jax.Array, b: jax.Array, *, transpose_b: bool = False) -> jax.Array:
    """``a @ b`` (``a @ bᵀ`` with ``transpose_b``) for (..., M, K) and (..., K, N) (or (..., N, K))
    with the same leading axes. Float32 operands on a CPU with the kernel library built take the
    custom call from :data:`MIN_MACS` multiply-adds on; anything else (small products, other dtypes,
    broadcast leading axes, 1-D operands, GPUs) is ``jnp.matmul``."""
    fused = (
        a.ndim >= 2
        and a.ndim == b.ndim
        and a.shape[:-2] == b.shape[:-2]
        and a.dtype == b.dtype == jnp.float32
        and math.prod(a.shape) * (b.shape[-2] if transpose_b else b.shape[-1]) >= MIN_MACS
        and available()
    )
    if not fused:
        return _reference(a, b, transpose_b)
    return _product(a, b, transpose_b)
