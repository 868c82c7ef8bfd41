"""The Newton–Schulz quintic iteration of Muon, ``X ← aX + (bG + cG²)X`` with ``G = XXᵀ``, over a
batch of same-shape matrices, as one custom call (all iterations, Gram matrices symmetric) with
the pure-JAX loop as reference. Used by :func:`zaya_jax.optim.muon.newton_schulz` when the kernels
are selected; normalisation and the transpose of tall matrices stay in JAX.

The pure-JAX path has two formulations of the same iteration:

* ``standard``: ``X ← aX + (bG + cG²)X``, ``G = XXᵀ``; per step and (m, n) matrix 4m²n + 2m³ FLOPs
  (a multiply-add counted as 2).
* ``gram``: every iterate is ``Xₖ = QₖX₀`` with ``Qₖ`` a polynomial in ``G₀ = X₀X₀ᵀ``, so the
  iteration runs on m x m matrices only: ``Pₖ = aI + bGₖ + cGₖ²``, ``Qₖ₊₁ = PₖQₖ``,
  ``Gₖ₊₁ = PₖGₖPₖ`` (symmetrised), and X is touched twice per segment (``G₀ = X₀X₀ᵀ`` and the
  final ``QX₀``). With ``Q₁ = P₀`` and no ``G`` after the last step, a segment of k steps costs
  4m²n + (8k - 6)m³. ``restart`` segments the steps: G is recomputed from the current X after
  ``restart`` steps, which bounds the float32 error of a G whose conditioning grows with k.

With j segments over s steps the Gram form saves (s - j)(4n - 6m)m² FLOPs: it is cheaper exactly
when n > 1.5m, whatever s and j (j < s). ``formulation="auto"`` picks per (m, n) statically.
"""

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


GRAM_RESTART = 3
"""Steps per Gram segment by default: 5 steps run as 3 + 2 (G recomputed from X once). Without a
restart the float32 result is ~2e-4 (relative Frobenius) off the float64 iteration on low-rank or
ill-conditioned input, 20x the standard iteration's own float32 error; with it, no worse than that."""

GRAM_MIN_ASPECT = 1.5
"""``auto`` uses the Gram formulation when n > GRAM_MIN_ASPECT * m (the FLOP crossover)."""

FORMULATIONS = ("auto", "standard", "gram")


def _symmetrise(g: jax.Array) -> jax.Array:
    return 0.5 * (g + jnp.swapaxes(g, -1, -2))


def _gram_segment(x: jax.Array, steps: int, a, b, c) -> jax.Array:
    """``steps`` (>= 1) iterations as ``Q X`` with Q a polynomial in ``G = X Xᵀ``."""
    m = x.shape[-2]
    eye = jnp.eye(m, dtype=jnp.float32)

    def poly(g):
        return a * eye + b * g + c * (g @ g)

    gram = x @ jnp.swapaxes(x, -1, -2)
    q = poly(gram)  # Q₁ = P₀
    if steps == 1:
        return q @ x

    def step(_, carry):
        q, gram = carry
        p = poly(gram)
        return p @ q, _symmetrise(p @ gram @ p)

    # Steps 2 .. steps-1 rolled; the last needs no next G.
    gram = _symmetrise(q @ gram @ q)
    q, gram = jax.lax.fori_loop(0, steps - 2, step, (q, gram))
    return (poly(gram) @ q) @ x


def newton_schulz_gram_reference(
    x: jax.Array, steps: int, a: float, b: float, c: float, restart: int = GRAM_RESTART
) -> jax.Array:
    """The iterations on the Gram matrix, G recomputed from X every ``restart`` steps (see module)."""
    a, b, c = (jnp.asarray(v, jnp.float32) for v in (a, b, c))
    done = 0
    while done < steps:
        k = min(restart, steps - done)
        x = _gram_segment(x, k, a, b, c)
        done += k
    return x


def gram_flops(m: int, n: int, steps: int, restart: int = GRAM_RESTART) -> int:
    """FLOPs of :func:`newton_schulz_gram_reference` on one (m, n) matrix."""
    segments = -(-steps // restart)
    return 4 * segments * m * m * n + (8 * steps - 6 * segments) * m**3


def standard_flops(m: int, n: int, steps: int) -> int:
    """FLOPs of :func:`newton_schulz_iterations_reference` on one (m, n) matrix."""
    return steps * (4 * m * m * n + 2 * m**3)


def resolve_formulation(formulation: str, m: int, n: int) -> str:
    """``standard`` or ``gram`` for a (m, n) matrix (m <= n); ``auto``: gram iff n > 1.5 m."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"unknown Newton-Schulz formulation {formulation!r}; use one of {FORMULATIONS}")
    if formulation == "auto":
        return "gram" if n > GRAM_MIN_ASPECT * m else "standard"
    return formulation


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
    x: jax.Array,
    steps: int,
    coeffs: tuple[float, float, float],
    *,
    impl: str = "custom",
    formulation: str = "auto",
    restart: int = GRAM_RESTART,
) -> jax.Array:
    """``steps`` iterations on float32 (..., m, n) matrices with m <= n (wide: transpose tall ones).

    ``impl="reference"``: pure JAX, ``formulation`` ``standard``, ``gram`` or ``auto`` (gram when
    n > 1.5 m, see the module docstring). ``impl="custom"``: the custom call, which runs the
    standard iteration (``auto`` means standard there; ``gram`` is not ported to it).
    """
    if x.ndim < 2 or x.shape[-2] > x.shape[-1]:
        raise ValueError(f"newton_schulz_iterations needs (..., m, n) with m <= n, got {x.shape}")
    if restart < 1:
        raise ValueError(f"restart={restart} must be >= 1")
    a, b, c = (float(v) for v in coeffs)
    x = x.astype(jnp.float32)
    chosen = resolve_formulation(formulation, x.shape[-2], x.shape[-1])
    if impl == "reference":
        if chosen == "gram":
            return newton_schulz_gram_reference(x, steps, a, b, c, restart)
        return newton_schulz_iterations_reference(x, steps, a, b, c)
    if impl != "custom":
        raise ValueError(f"unknown impl {impl!r}; use 'custom' or 'reference'")
    if formulation == "gram":
        raise ValueError("the custom call runs the standard iteration; use impl='reference' for 'gram'")
    return _iterate(x, int(steps), a, b, c)
