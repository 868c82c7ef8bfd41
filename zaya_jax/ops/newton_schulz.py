"""The Newton–Schulz quintic iteration of Muon, ``X ← aX + (bG + cG²)X`` with ``G = XXᵀ``, over a
batch of same-shape matrices, as one custom call (all iterations, Gram matrices symmetric) with
the pure-JAX loop as reference. Used by :func:`zaya_jax.optim.muon.newton_schulz` when the kernels
are selected; normalisation and the transpose of tall matrices stay in JAX.

The pure-JAX path has two formulations of the same iteration:

* ``standard``: ``X ← aX + (bG + cG²)X``, ``G = XXᵀ``; per step and (m, n) matrix 4m²n + 2m³ FLOPs
  (a multiply-add counted as 2).
* ``gram``: every iterate is ``Xₖ = QₖX₀`` with ``Qₖ`` a polynomial in ``G₀ = X₀X₀ᵀ``, so the
  iteration runs on m x m matrices only: ``Pₖ = aI + bGₖ + cGₖ²``, ``Qₖ₊₁ = PₖQₖ``,
  ``Gₖ₊₁ = PₖGₖPₖ`` (symmetrised). With ``Q₁ = P₀`` and no ``G`` after the last step, k steps
  cost (8k - 6)m³. Float32 G loses the small singular values' accuracy as Q grows, so the steps run
  in segments of ``restart`` (3: 5 = 3 + 2) and each later segment starts from the Gram matrix of
  the current ``X = QX₀``, accumulated a block of m columns at a time (never storing that X);
  the result is ``(Q'Q)X₀``. X (m, n) is read 2j times for j segments.

FLOPs for s steps in j segments: 4jm²n + (8s - 4j - 2)m³ against
s(4m²n + 2m³): the Gram form is cheaper when n > m(6s - 4j - 2)/(4(s - j)), 5m/3 for s=5, j=2
(1.5m without a restart). ``formulation="auto"`` picks per (m, n) statically, and waits until
n >= 4m (and, in :func:`zaya_jax.optim.muon.newton_schulz`, a wide stored matrix), where the Gram form's temporaries (about 5 m x m per matrix) are no more than the
standard loop's (X + one m x m); see :data:`GRAM_MIN_ASPECT`.

Both formulations are XLA's matmuls only (``optim.kernels=reference``: no custom call). On a CPU the
kernel plan's default runs each leaf's iteration as one custom call instead
(:mod:`zaya_jax.ops.newton_schulz_cpu`), which this loop is the reference of.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.ops.platform import planning_target
from zaya_jax.ops.residual_norm import _dispatch


def newton_schulz_iterations_reference(x: jax.Array, steps: int, a: float, b: float, c: float) -> jax.Array:
    a, b, c = (jnp.asarray(v, jnp.float32) for v in (a, b, c))

    def step(_, x):
        gram = x @ jnp.swapaxes(x, -1, -2)
        return a * x + (b * gram + (c * gram) @ gram) @ x

    return jax.lax.fori_loop(0, steps, step, x)


GRAM_RESTART = 3
"""Steps per Gram segment by default: 5 steps run as 3 + 2 (G recomputed from X once). Measured on
the tiny and ZAYA1-8B leaf shapes with low-rank or ill-conditioned input, without a restart the
float32 result is up to ~5e-4 (relative Frobenius) off the float64 iteration; with it <= 2.1e-5,
about twice the standard iteration's own float32 error (<= 1.0e-5)."""

GRAM_MIN_ASPECT = 4
"""``auto`` uses the Gram formulation when n >= GRAM_MIN_ASPECT * m. It has fewer FLOPs from
n > 5m/3, but its temporaries are about five m x m matrices per matrix against the standard
iteration's X plus one m x m (mn + m²): below n = 4m it needs more memory (ZAYA1-8B's experts wi,
n = 2m: 50 instead of 30 GiB), from there no more."""

FORMULATIONS = ("auto", "standard", "gram")


def _symmetrise(g: jax.Array) -> jax.Array:
    return 0.5 * (g + jnp.swapaxes(g, -1, -2))


def _gram_polynomial(gram: jax.Array, steps: int, a, b, c) -> jax.Array:
    """Q with ``steps`` (>= 1) iterations taking X to Q X, from ``G = X Xᵀ`` only."""
    eye = jnp.eye(gram.shape[-1], dtype=jnp.float32)

    def poly(g):
        return a * eye + b * g + c * (g @ g)

    q = poly(gram)  # Q₁ = P₀
    if steps == 1:
        return q

    def step(_, carry):
        q, gram = carry
        p = poly(gram)
        return p @ q, _symmetrise((p @ gram) @ p)

    # Steps 2 .. steps-1 rolled; the last needs no next G.
    gram = _symmetrise((q @ gram) @ q)
    q, gram = jax.lax.fori_loop(0, steps - 2, step, (q, gram))
    return poly(gram) @ q


def _gram(x: jax.Array, tall: bool) -> jax.Array:
    """The m x m Gram matrix of the short side: ``XXᵀ``, or ``XᵀX`` for a tall X."""
    return jnp.swapaxes(x, -1, -2) @ x if tall else x @ jnp.swapaxes(x, -1, -2)


def _apply(q: jax.Array, x: jax.Array, tall: bool) -> jax.Array:
    """``Q X`` in X's orientation: ``X Qᵀ`` (= ``(Q Xᵀ)ᵀ``) for a tall X."""
    return x @ jnp.swapaxes(q, -1, -2) if tall else q @ x


def _gram_of_product(q: jax.Array, x: jax.Array, tall: bool) -> jax.Array:
    """The Gram matrix of ``Q X``, a block of m of X's long side at a time: no X-sized temporary
    (when m divides n; else ``Q X`` is formed whole)."""
    m = q.shape[-1]
    long_axis = x.ndim - 2 if tall else x.ndim - 1
    n = x.shape[long_axis]
    if n % m or n == m:
        return _gram(_apply(q, x, tall), tall)

    def of_block(i):
        return _gram(_apply(q, jax.lax.dynamic_slice_in_dim(x, i * m, m, axis=long_axis), tall), tall)

    # The first block starts the sum (not zeros): inside shard_map the carry then has the
    # device-varying type of the blocks' products (a fresh zeros array would not).
    return jax.lax.fori_loop(1, n // m, lambda i, gram: gram + of_block(i), of_block(0))


def newton_schulz_gram_reference(
    x: jax.Array,
    steps: int,
    a: float,
    b: float,
    c: float,
    restart: int = GRAM_RESTART,
    norm: jax.Array | None = None,
) -> jax.Array:
    """The iterations on the Gram matrix, G recomputed from X every ``restart`` steps (see module).

    x: float32 (..., A, B) of either orientation (the Gram matrix is of the short side);
    ``norm`` (broadcastable to x, optional): iterate on ``x / norm``, folded into G and Q so that
    the normalised X is never stored. The restart's ``Xₖ = QₖX₀`` is not stored either: its Gram
    matrix is accumulated a block of columns at a time and the result is ``(Q'Qₖ)X₀``, so the
    temporaries are m x m matrices only (in X's place, the standard iteration's loop carry).
    """
    if restart < 1:
        raise ValueError(f"restart={restart} must be >= 1")
    a, b, c = (jnp.asarray(v, jnp.float32) for v in (a, b, c))
    tall = x.shape[-2] > x.shape[-1]
    total = None
    done = 0
    while done < steps:
        k = min(restart, steps - done)
        if total is None:
            gram = _gram(x, tall)
            if norm is not None:
                gram = gram / jnp.square(norm)
        else:
            gram = _gram_of_product(total, x, tall)
        q = _gram_polynomial(gram, k, a, b, c)
        if total is None and norm is not None:
            q = q / norm
        total = q if total is None else q @ total
        done += k
    return _apply(total, x, tall)


def gram_flops(m: int, n: int, steps: int, restart: int = GRAM_RESTART) -> int:
    """FLOPs of :func:`newton_schulz_gram_reference` on one (m, n) matrix."""
    segments = -(-steps // restart)
    return 4 * segments * m * m * n + (8 * steps - 4 * segments - 2) * m**3


def standard_flops(m: int, n: int, steps: int) -> int:
    """FLOPs of :func:`newton_schulz_iterations_reference` on one (m, n) matrix."""
    return steps * (4 * m * m * n + 2 * m**3)


def full_float32_matmuls() -> bool:
    """Whether float32 matmuls traced now run at full float32 precision: on CPU, or under
    ``jax_default_matmul_precision`` ``highest``/``float32`` (NVIDIA GPUs default to TF32). A
    program planned for another platform (:func:`~zaya_jax.ops.platform.planning_for`, e.g. the GPU
    program compiled on a CPU by ``zaya train --compile-only``) is that platform's."""
    precision = jax.config.jax_default_matmul_precision
    if precision is not None and str(precision).lower() in ("highest", "float32", "f32_f32_f32"):
        return True
    target = planning_target()
    return target == "cpu" if target is not None else jax.default_backend() == "cpu"


def resolve_formulation(formulation: str, m: int, n: int, full_precision: bool = True) -> str:
    """``standard`` or ``gram`` for a (m, n) matrix (m <= n); ``auto``: gram iff n >= 4m and
    ``full_precision`` (float32 matmuls at full precision: with TF32 matmuls the Gram form drifts to
    ~1-2% off float64 on low-rank or ill-conditioned input where the standard one stays < 0.1%,
    in a CPU emulation of TF32; not measured on a GPU)."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"unknown Newton-Schulz formulation {formulation!r}; use one of {FORMULATIONS}")
    if formulation == "auto":
        return "gram" if full_precision and n >= GRAM_MIN_ASPECT * m else "standard"
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
    n >= 4m and float32 matmuls run at full precision, see the module docstring). ``impl="custom"``: the custom call, which runs the
    standard iteration (``auto`` means standard there; ``gram`` is not ported to it).
    """
    if x.ndim < 2 or x.shape[-2] > x.shape[-1]:
        raise ValueError(f"newton_schulz_iterations needs (..., m, n) with m <= n, got {x.shape}")
    if restart < 1:
        raise ValueError(f"restart={restart} must be >= 1")
    a, b, c = (float(v) for v in coeffs)
    x = x.astype(jnp.float32)
    chosen = resolve_formulation(formulation, x.shape[-2], x.shape[-1], full_float32_matmuls())
    if impl == "reference":
        if chosen == "gram":
            return newton_schulz_gram_reference(x, steps, a, b, c, restart)
        return newton_schulz_iterations_reference(x, steps, a, b, c)
    if impl != "custom":
        raise ValueError(f"unknown impl {impl!r}; use 'custom' or 'reference'")
    if formulation == "gram":
        raise ValueError("the custom call runs the standard iteration; use impl='reference' for 'gram'")
    return _iterate(x, int(steps), a, b, c)
