"""Fused attention on CPU as one XLA FFI custom call per direction (``custom_calls/cpu/attention_cpu.cc``):
flash-style forward and backward over key blocks with CCA's whole mask description (causal slots,
document ids, padding keys, a sliding window; the per-row vectors of
:func:`zaya_jax.ops.attention.masks.mask_rows`), GQA without repeating K/V, the log-sum-exp output
with its own cotangent (the ring merges partial results with it), threads over (batch, KV head,
block) on XLA's intra-op pool.

Why a custom call: written in JAX, the blocked kernel's skinny products (head width 32 at ``tiny``)
and the element-wise passes over each score tile run at about 4x the matmul roofline on XLA:CPU
(bench/RESULTS.md), where PyTorch runs a fused flash kernel; XLA:CPU fuses neither the products with
the softmax nor the tiles with each other. The blocked kernel stays the reference (tests compare
values and gradients for every mask kind). Where the library is not built or the device is not a
CPU, :func:`cpu_attention` runs the blocked kernel (:mod:`zaya_jax.ops.attention.blocked`) instead,
the one kernel this module imports besides the masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.ops._registry import registered_target
from zaya_jax.ops.attention.blocked import blocked_attention
from zaya_jax.ops.attention.masks import AttentionMask, check_fused_inputs, mask_rows

FORWARD, BACKWARD = "zaya_attention_fwd", "zaya_attention_bwd"


def _rows(rows):
    q_slot, q_low, q_seg, k_slot, _, k_seg = rows
    return q_slot, q_low, q_seg, k_slot, k_seg


def _ffi_forward(q, k, v, rows, scale):
    batch, seq_q, heads, _ = q.shape
    call = jax.ffi.ffi_call(
        FORWARD,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, seq_q, heads), jnp.float32)),
    )
    return call(q, k, v, *_rows(rows), scale=np.float32(scale))


def _ffi_backward(q, k, v, rows, out, lse, d_out, d_lse, scale):
    call = jax.ffi.ffi_call(
        BACKWARD,
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
    )
    return call(
        q,
        k,
        v,
        *_rows(rows),
        out,
        lse,
        d_out.astype(q.dtype),
        d_lse.astype(jnp.float32),
        scale=np.float32(scale),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(q, k, v, rows, scale):
    return _ffi_forward(q, k, v, rows, scale)


def _fused_forward(q, k, v, rows, scale):
    out, lse = _ffi_forward(q, k, v, rows, scale)
    return (out, lse), (q, k, v, rows, out, lse)


def _fused_backward(scale, residuals, cotangents):
    q, k, v, rows, out, lse = residuals
    dq, dk, dv = _ffi_backward(q, k, v, rows, out, lse, *cotangents, scale)
    return dq, dk, dv, jax.tree.map(lambda _: None, rows)


_fused.defvjp(_fused_forward, _fused_backward)


def available() -> bool:
    """Whether the custom call is registered (the CPU library is built and loads)."""
    return registered_target("cpu", FORWARD) and registered_target("cpu", BACKWARD)


def cpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, *, block: int = 128):
    """Fused attention. q: (batch, seq_q, nq, d); k, v: (batch, seq_k, nk, d) in float32 or
    bfloat16. Returns (out (batch, seq_q, nq, d) in q's dtype, lse (batch, seq_q, nq) float32),
    equal to :func:`zaya_jax.ops.attention.blocked.blocked_attention` in value and gradient. On a device
    that is not a CPU, or without the built library, the blocked kernel (``block``) runs instead."""
    check_fused_inputs(q, k, mask)
    batch, seq_q, _, width = q.shape
    seq_k = k.shape[1]
    if not available():
        return blocked_attention(q, k, v, mask, block=block)
    rows = mask_rows(mask, batch, seq_q, seq_k, seq_q, seq_k)
    scale = width**-0.5

    def fused(q, k, v, rows):
        return _fused(q, k, v, rows, scale)

    def blocked(q, k, v, rows):
        return blocked_attention(q, k, v, mask, block=block)

    return jax.lax.platform_dependent(q, k, v, rows, cpu=fused, default=blocked)
