"""Muon's Newton–Schulz iteration on CPU as one XLA FFI custom call per leaf
(``custom_calls/cpu/newton_schulz_cpu.cc``): each matrix of the stack is one work item on XLA's
intra-op pool and goes through all of its steps while it stays in that core's cache, in the
standard formulation or the Gram one (:mod:`zaya_jax.ops.newton_schulz`), its symmetric m x m
products computed as their upper triangle.

Why a custom call: as JAX operations each step is five to eight passes over the whole stack (two or
three batched products, scalings, sums, the loop), and ``tiny``'s Muon leaves were orthogonalised
at 116 GFLOP/s where the batched products alone ran at 140-150 (bench/RESULTS.md, issue 41). The
kernel also skips the lower half of each symmetric product, which XLA's dots cannot.

``auto`` picks per (m, n) the formulation with fewer FLOPs as the kernel counts them (:func:`flops`):
the Gram form from n >= 1.36m at m = 128 (1.23m at 2048; its temporaries are per worker here, not
per matrix, so the memory bound that keeps XLA's Gram form to n >= 4m does not apply). float32 only;
:func:`zaya_jax.optim.muon.newton_schulz` takes it on CPU when the library is built, and runs the
JAX iteration elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.ops._registry import registered_target
from zaya_jax.ops.manual_axes import typed_like_reference
from zaya_jax.ops.newton_schulz import FORMULATIONS, GRAM_RESTART, newton_schulz_iterations

TARGET = "zaya_newton_schulz_cpu"
BLOCK = 32
"""The symmetric products' block size: only blocks on and above the diagonal are computed."""


def available() -> bool:
    """Whether the custom call is registered (the CPU library is built and loads)."""
    return registered_target("cpu", TARGET)


def _symmetric_product_flops(m: int, k: int) -> int:
    """FLOPs of an m x m result known to be symmetric, contracted over k: its upper block triangle."""
    blocks = -(-m // BLOCK)
    return 2 * m * k * min(m, BLOCK * (blocks + 1) // 2)


def flops(m: int, n: int, steps: int, formulation: str, restart: int = GRAM_RESTART) -> int:
    """FLOPs the kernel spends on one (m, n) matrix (m <= n) in ``formulation`` (standard or gram)."""
    gram, square, apply = _symmetric_product_flops(m, n), _symmetric_product_flops(m, m), 2 * m * m * n
    if formulation == "standard":
        return steps * (gram + square + apply)
    segments = -(-steps // restart)
    # per segment of k steps: 3 + 4(k - 2) + 2 symmetric m x m products for k >= 2 (1 for k = 1);
    # the segments after the first: G from total X0 (one apply, one Gram) and total <- Q total, in full
    products, done = 0, 0
    for _ in range(segments):
        k = min(restart, steps - done)
        products += 1 if k == 1 else 4 * k - 3
        done += k
    carried = (segments - 1) * 2 * m**3
    return segments * gram + (segments - 1) * apply + products * square + carried + apply


def resolve(formulation: str, m: int, n: int, steps: int, restart: int = GRAM_RESTART) -> str:
    """``standard`` or ``gram`` for the kernel; ``auto``: the one with fewer :func:`flops`."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"unknown Newton-Schulz formulation {formulation!r}; use one of {FORMULATIONS}")
    if formulation != "auto":
        return formulation
    gram, standard = (flops(m, n, steps, f, restart) for f in ("gram", "standard"))
    return "gram" if gram < standard else "standard"


def _call(x, steps, a, b, c, gram, restart):
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32), vmap_method="broadcast_all")
    return (
        call(
            x,
            steps=np.int32(steps),
            a=np.float32(a),
            b=np.float32(b),
            c=np.float32(c),
            gram=gram,
            restart=np.int32(restart),
        ),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _iterate(x, steps, coeffs, formulation_restart):
    formulation, restart = formulation_restart
    a, b, c = coeffs
    kernel = functools.partial(_call, steps=steps, a=a, b=b, c=c, gram=formulation == "gram", restart=restart)
    return typed_like_reference(kernel)(x)[0]


def _iterate_forward(x, steps, coeffs, formulation_restart):
    return _iterate(x, steps, coeffs, formulation_restart), x


def _iterate_backward(steps, coeffs, formulation_restart, x, ct):  # through JAX: Muon never differentiates it
    formulation, restart = formulation_restart
    _, vjp = jax.vjp(
        lambda x: newton_schulz_iterations(
            x, steps, coeffs, impl="reference", formulation=formulation, restart=restart
        ),
        x,
    )
    return vjp(ct)


_iterate.defvjp(_iterate_forward, _iterate_backward)


def cpu_newton_schulz(
    x: jax.Array,
    steps: int,
    coeffs: tuple[float, float, float],
    formulation: str = "auto",
    restart: int = GRAM_RESTART,
) -> jax.Array:
    """``steps`` quintic iterations on float32 (..., m, n) matrices with m <= n, already normalised
    (Frobenius norm <= 1), as the custom call; ``formulation``: standard, gram or auto (:func:`resolve`).
    Raises where the library is not built (check :func:`available`)."""
    if x.ndim < 2 or x.shape[-2] > x.shape[-1]:
        raise ValueError(f"cpu_newton_schulz needs (..., m, n) with m <= n, got {x.shape}")
    if x.dtype != jnp.float32:
        raise ValueError(f"cpu_newton_schulz runs on float32, got {x.dtype}")
    if steps < 0 or restart < 1:
        raise ValueError(f"steps={steps} must be >= 0 and restart={restart} >= 1")
    if not available():
        raise RuntimeError(f"{TARGET} is not registered: build the CPU kernels (custom_calls/build.py)")
    chosen = resolve(formulation, x.shape[-2], x.shape[-1], steps, restart)
    coeffs = tuple(float(v) for v in coeffs)
    return _iterate(x, int(steps), coeffs, (chosen, int(restart)))
