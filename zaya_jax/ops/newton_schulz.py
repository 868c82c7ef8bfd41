"""The Newton–Schulz quintic iteration of Muon, ``X ← aX + (bG + cG²)X`` with ``G = XXᵀ``, over a
batch of same-shape matrices, as one custom call (all iterations, Gram matrices symmetric) with
the pure-JAX loop as reference. Used by :func:`zaya_jax.optim.muon.newton_schulz` when the kernels
are selected; normalisation and the transpose of tall matrices stay in JAX."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.ops.residual_norm import _dispatch


def newton_schulz_iterations_reference(x: jax.Array, steps: int, a: float, b: float, c: float) -> jax.Array:
    a, b, c = (jnp.asarray(v, jnp.float32) for v in (a, b, c))

    def step(_, x):
        gram = x @ jnp.swapaxes(x, -1, -2)
        return a * x + (b * gram + c * gram @ gram) @ x

    return jax.lax.fori_loop(0, steps, step, x)


def _ffi(x, steps, a, b, c):
    call = jax.ffi.ffi_call(
        "zaya_newton_schulz", (jax.ShapeDtypeStruct(x.shape, jnp.float32),), vmap_method="broadcast_all"
    )
    return call(x, steps=np.int32(steps), a=np.float32(a), b=np.float32(b), c=np.float32(c))


def _reference(x, steps, a, b, c):
    return (newton_schulz_iterations_reference(x, steps, a, b, c),)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _iterate(x, steps, a, b, c):
    return _dispatch(
        functools.partial(_ffi, steps=steps, a=a, b=b, c=c),
        functools.partial(_reference, steps=steps, a=a, b=b, c=c),
        x,
    )[0]


def _iterate_fwd(x, steps, a, b, c):
    return _iterate(x, steps, a, b, c), x


def _iterate_bwd(steps, a, b, c, x, ct):  # through the reference: Muon never differentiates this
    _, vjp = jax.vjp(lambda x: newton_schulz_iterations_reference(x, steps, a, b, c), x)
    return vjp(ct)


_iterate.defvjp(_iterate_fwd, _iterate_bwd)


def newton_schulz_iterations(
    x: jax.Array, steps: int, coeffs: tuple[float, float, float], *, impl: str = "custom"
) -> jax.Array:
    """``steps`` iterations on float32 (..., m, n) matrices with m <= n (wide: transpose tall ones)."""
    if x.ndim < 2 or x.shape[-2] > x.shape[-1]:
        raise ValueError(f"newton_schulz_iterations needs (..., m, n) with m <= n, got {x.shape}")
    a, b, c = (float(v) for v in coeffs)
    x = x.astype(jnp.float32)
    if impl == "reference":
        return newton_schulz_iterations_reference(x, steps, a, b, c)
    if impl != "custom":
        raise ValueError(f"unknown impl {impl!r}; use 'custom' or 'reference'")
    return _iterate(x, int(steps), a, b, c)
