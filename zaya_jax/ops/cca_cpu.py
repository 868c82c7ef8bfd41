"""CCA's query/key path on CPU as one XLA FFI custom call per direction (``custom_calls/cpu/cca_cpu.cc``):
from the raw projections ``z = [q0 || k0]`` to the attention's q and k: the two-stage causal
convolution (restarting at document boundaries), the "mean" residuals, the L2 normalisation to
sqrt(d), the keys' temperature and the partial NeoX RoPE (spec §2.3 steps 2-6), threaded over
(batch row, 64-position chunk) on XLA's intra-op pool. The backward recomputes the forward from the
inputs (all but the heads before normalisation, which the forward saves) and sums the parameter
gradients in a fixed order (the same bits on every call).

Why a custom call: written in JAX (:mod:`zaya_jax.model.cca`, the reference, which every other
path runs), these steps are some forty small operations per layer that XLA:CPU runs one after
another at a few ns per element: 30 of the 123 ms of `tiny`'s 16 x 128 forward and backward pass
(bench/RESULTS.md, issue 41). float32 only; the model keeps the JAX steps for other dtypes, other
devices, context parallelism, decoding, and where the library is not built.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.ops._registry import registered_target

FORWARD, BACKWARD = "zaya_cca_qk_fwd", "zaya_cca_qk_bwd"


def available() -> bool:
    """Whether both custom calls are registered (the CPU library is built and loads)."""
    return registered_target("cpu", FORWARD) and registered_target("cpu", BACKWARD)


def _attrs(nq: int, nk: int) -> dict[str, np.int64]:
    return {"nq": np.int64(nq), "nk": np.int64(nk)}


def _forward(inputs, nq, nk):
    z = inputs[0]
    batch, seq, channels = z.shape
    d = channels // (nq + nk)
    call = jax.ffi.ffi_call(
        FORWARD,
        (
            jax.ShapeDtypeStruct((batch, seq, nq, d), jnp.float32),
            jax.ShapeDtypeStruct((batch, seq, nk, d), jnp.float32),
            jax.ShapeDtypeStruct(z.shape, jnp.float32),  # the heads before normalisation
        ),
    )
    return call(*inputs, **_attrs(nq, nk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fused(inputs, nq, nk):
    return _forward(inputs, nq, nk)[:2]


def _fused_forward(inputs, nq, nk):
    q, k, pre = _forward(inputs, nq, nk)
    return (q, k), (inputs, pre)


def _fused_backward(nq, nk, residuals, cotangents):
    inputs, pre = residuals
    cos, sin, segments = inputs[6:]
    dq, dk = cotangents
    call = jax.ffi.ffi_call(BACKWARD, tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in inputs[:6]))
    grads = call(*inputs, pre, dq.astype(jnp.float32), dk.astype(jnp.float32), **_attrs(nq, nk))
    # the RoPE tables come from integer positions and fixed frequencies: no gradient
    return ((*grads, jnp.zeros_like(cos), jnp.zeros_like(sin), np.zeros(segments.shape, jax.dtypes.float0)),)


_fused.defvjp(_fused_forward, _fused_backward)


def cpu_cca_qk(
    z: jax.Array,
    dw_kernel: jax.Array,
    dw_bias: jax.Array,
    g_kernel: jax.Array,
    g_bias: jax.Array,
    temp: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    segment_ids: jax.Array,
    *,
    nq: int,
    nk: int,
) -> tuple[jax.Array, jax.Array]:
    """(q (batch, seq, nq, d), k (batch, seq, nk, d)) from z (batch, seq, (nq + nk) d), the
    convolutions' dw_kernel (k0, C), dw_bias (C,), g_kernel (k1, nq + nk, d, d), g_bias (C,), the
    keys' temp (nk,), RoPE cos and sin (batch, seq, rd) and segment_ids (batch, seq) (a document
    starts where the id changes); equal to the JAX steps of :mod:`zaya_jax.model.cca`.
    Differentiable in everything but the tables and ids. float32; runs on a CPU only."""
    operands = (z, dw_kernel, dw_bias, g_kernel, g_bias, temp, cos, sin)
    if any(x.dtype != jnp.float32 for x in operands):
        raise TypeError(f"cpu_cca_qk takes float32 operands, got {sorted({str(x.dtype) for x in operands})}")
    if not available():  # also registers the targets on first use
        raise RuntimeError(
            "the CPU kernel library lacks zaya_cca_qk_*: rebuild with python custom_calls/build.py"
        )
    cos, sin = jax.lax.stop_gradient(cos), jax.lax.stop_gradient(sin)
    return _fused((*operands[:6], cos, sin, segment_ids.astype(jnp.int32)), int(nq), int(nk))
