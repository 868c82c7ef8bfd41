"""Fused residual scaling + RMSNorm: ``h' = (h + rb)·rs + (f + hb)·hs`` then ``y = RMSNorm(h')``
(the block's attention merge followed by the MoE's input norm, spec §2.2), as one custom call
forward and one backward, with a pure-JAX reference.

Every leading axis of ``f``/``h`` is a row axis. Parameters travel as one (5, H) float32 stack
(branch bias, branch scale, residual bias, residual scale, norm weight); under ``vmap`` they gain
leading axes, which the kernels read as groups of consecutive rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.ops._registry import PLATFORMS, registered
from zaya_jax.ops.manual_axes import typed_like_reference


def residual_rms_norm_reference(f: jax.Array, h: jax.Array, params: jax.Array, eps: float):
    """The pure-JAX definition (what ``ResidualScaling`` then ``RMSNorm`` compute)."""
    dtype = f.dtype
    hb, hs, rb, rs, w = (params[..., i, :] for i in range(5))
    if params.ndim > 2:  # grouped rows (as the kernels see a vmapped call): broadcast per group
        groups = int(np.prod(params.shape[:-2]))
        shape = f.shape
        f, h = f.reshape(groups, -1, shape[-1]), h.reshape(groups, -1, shape[-1])
        hb, hs, rb, rs, w = (p.reshape(groups, 1, -1) for p in (hb, hs, rb, rs, w))
    branch = (f + hb.astype(dtype)) * hs.astype(dtype)
    h_new = (h + rb) * rs + branch.astype(jnp.float32)
    x = h_new.astype(dtype).astype(jnp.float32)  # zaya_jax.model.norms.rms_norm, spelled out
    normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    y = w.astype(dtype) * normed.astype(dtype)
    if params.ndim > 2:
        h_new, y = h_new.reshape(shape), y.reshape(shape)
    return h_new, y


def _ffi_forward(f, h, params, eps):
    call = jax.ffi.ffi_call(
        "zaya_residual_rms_norm_fwd",
        (jax.ShapeDtypeStruct(h.shape, jnp.float32), jax.ShapeDtypeStruct(f.shape, f.dtype)),
        vmap_method="broadcast_all",
    )
    return call(f, h, params, eps=np.float32(eps))


def _ffi_backward(f, h, params, dh_out, dy, eps):
    call = jax.ffi.ffi_call(
        "zaya_residual_rms_norm_bwd",
        (
            jax.ShapeDtypeStruct(f.shape, f.dtype),
            jax.ShapeDtypeStruct(h.shape, jnp.float32),
            jax.ShapeDtypeStruct(params.shape, jnp.float32),
        ),
        vmap_method="broadcast_all",
    )
    return call(f, h, params, dh_out, dy, eps=np.float32(eps))


def _reference_backward(f, h, params, dh_out, dy, eps):
    _, vjp = jax.vjp(lambda f, h, p: residual_rms_norm_reference(f, h, p, eps), f, h, params)
    return vjp((dh_out, dy))


def _dispatch(kernel, reference, *args, like=None):
    """The custom call on each platform where it is registered, the reference elsewhere."""
    kernel = typed_like_reference(kernel, like)
    branches = {p: kernel for p in PLATFORMS if registered(p)}
    if not branches:
        return reference(*args)
    return jax.lax.platform_dependent(*args, default=reference, **branches)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(f, h, params, eps):
    return _dispatch(
        functools.partial(_ffi_forward, eps=eps),
        functools.partial(residual_rms_norm_reference, eps=eps),
        f,
        h,
        params,
    )


def _fused_fwd(f, h, params, eps):
    return _fused(f, h, params, eps), (f, h, params)


def _fused_bwd(eps, residuals, cotangents):
    f, h, params = residuals
    dh_out, dy = cotangents
    return _dispatch(
        functools.partial(_ffi_backward, eps=eps),
        functools.partial(_reference_backward, eps=eps),
        f,
        h,
        params,
        dh_out.astype(jnp.float32),
        dy.astype(f.dtype),
        like=(0, 1, 2),
    )


_fused.defvjp(_fused_fwd, _fused_bwd)


def stack_params(hidden_bias, hidden_scale, residual_bias, residual_scale, norm_weight, dtype) -> jax.Array:
    """The (5, H) float32 stack, branch parameters and norm weight rounded to the compute dtype
    first (as the modules cast them), so kernels and reference see the same values."""
    in_dtype = [hidden_bias, hidden_scale, None, None, norm_weight]
    rows = []
    for value, rounded in zip(
        (hidden_bias, hidden_scale, residual_bias, residual_scale, norm_weight), in_dtype, strict=True
    ):
        value = value.astype(dtype) if rounded is not None else value
        rows.append(value.astype(jnp.float32))
    return jnp.stack(rows)


def residual_rms_norm(
    f: jax.Array,
    h: jax.Array,
    hidden_bias: jax.Array,
    hidden_scale: jax.Array,
    residual_bias: jax.Array,
    residual_scale: jax.Array,
    norm_weight: jax.Array,
    *,
    eps: float,
    impl: str = "custom",
) -> tuple[jax.Array, jax.Array]:
    """``(h', RMSNorm(h'))`` for branch output ``f`` (compute dtype) and float32 residual ``h``, both
    (..., H). ``impl``: ``custom`` (the custom call where registered, else the reference) or
    ``reference``. Differentiable in every argument."""
    if f.shape != h.shape:
        raise ValueError(f"residual_rms_norm: f {f.shape} and h {h.shape} must have the same shape")
    params = stack_params(hidden_bias, hidden_scale, residual_bias, residual_scale, norm_weight, f.dtype)
    h = h.astype(jnp.float32)
    if impl == "reference":
        return residual_rms_norm_reference(f, h, params, eps)
    if impl != "custom":
        raise ValueError(f"unknown impl {impl!r}; use 'custom' or 'reference'")
    return _fused(f, h, params, float(eps))


def sharded_residual_rms_norm(
    mesh: jax.sharding.Mesh, rows: jax.sharding.PartitionSpec, impl: str = "custom"
):
    """:func:`residual_rms_norm` inside a ``shard_map`` over ``mesh``: ``rows`` is the
    PartitionSpec of f and h (every axis but the last may be split; the last must not be), the
    parameters are replicated. A custom call left to GSPMD would gather its inputs first."""
    from jax.sharding import PartitionSpec

    if len(rows) and rows[-1] is not None:
        raise ValueError(f"the feature axis of a row-wise norm cannot be split: {rows}")

    def fn(f, h, hb, hs, rb, rs, w, *, eps):
        local = functools.partial(residual_rms_norm, eps=eps, impl=impl)
        vector = PartitionSpec(None)
        mapped = jax.shard_map(
            local, mesh=mesh, in_specs=(rows, rows, *(vector,) * 5), out_specs=(rows, rows)
        )
        return mapped(f, h, hb, hs, rb, rs, w)

    return fn
