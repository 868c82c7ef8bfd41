"""The CPU batched-GEMM custom call behind Newton–Schulz (``zaya_jax.ops.batched_matmul``) equals
``jnp.matmul``: with and without the transposed right operand, widths off its 8 x 32 register tile,
contractions past its 256-deep blocks, several batch axes, under ``vmap`` and in gradients; small,
broadcast or non-float32 products stay with XLA; and Newton–Schulz runs it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.ops.batched_matmul import MIN_MACS, TARGET, available, matmul
from zaya_jax.ops.newton_schulz import newton_schulz_iterations


def _operands(batch, m, k, n, transpose_b=False, seed=0):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.normal(size=(*batch, m, k)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(*batch, *((n, k) if transpose_b else (k, n)))), jnp.float32)
    return a, b


def _reference(a, b, transpose_b):
    return a @ (jnp.swapaxes(b, -1, -2) if transpose_b else b)


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize(
    ("batch", "m", "k", "n"),
    [
        ((16,), 128, 128, 512),  # Newton-Schulz's (bG + cG²)X at tiny's experts
        ((12,), 70, 600, 45),  # rows off the 8-row tile, 3 contraction blocks, a partial panel
        ((4, 5), 72, 130, 96),  # two batch axes
    ],
)
def test_it_equals_jnp_matmul(batch, m, k, n, transpose_b):
    a, b = _operands(batch, m, k, n, transpose_b)
    fn = jax.jit(lambda a, b: matmul(a, b, transpose_b=transpose_b))
    assert TARGET in fn.lower(a, b).as_text(), "the product did not take the custom call"
    np.testing.assert_allclose(fn(a, b), _reference(a, b, transpose_b), atol=2e-5 * np.sqrt(k), rtol=0)


def test_vmap_and_gradients():
    a, b = _operands((4,), 64, 96, 80)
    got = jax.vmap(matmul)(jnp.stack([a, 2 * a]), jnp.stack([b, b]))
    np.testing.assert_allclose(got[1], 2 * (a @ b), atol=1e-3, rtol=0)
    probe = jnp.asarray(np.random.default_rng(1).normal(size=(4, 64, 80)), jnp.float32)
    grads = jax.grad(lambda a, b: jnp.sum(matmul(a, b) * probe), argnums=(0, 1))(a, b)
    expected = jax.grad(lambda a, b: jnp.sum((a @ b) * probe), argnums=(0, 1))(a, b)
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "dtype"),
    [
        ((4, 32, 32), (4, 32, 32), jnp.float32),  # below MIN_MACS
        ((16, 128, 128), (128, 512), jnp.float32),  # a broadcast right operand
        ((16, 128, 128), (16, 128, 512), jnp.bfloat16),
    ],
)
def test_what_stays_with_xla(a_shape, b_shape, dtype):
    a, b = jnp.ones(a_shape, dtype), jnp.ones(b_shape, dtype)
    text = jax.jit(matmul).lower(a, b).as_text()
    assert TARGET not in text
    np.testing.assert_array_equal(jax.jit(matmul)(a, b), a @ b)


def test_newton_schulz_runs_it():
    assert available() and MIN_MACS <= 16 * 128 * 128 * 512
    x = jnp.asarray(np.random.default_rng(2).normal(size=(16, 128, 512)) / 256, jnp.float32)
    for formulation in ("standard", "gram"):
        run = functools.partial(
            newton_schulz_iterations, steps=5, coeffs=(3.4445, -4.775, 2.0315), formulation=formulation
        )
        assert TARGET in jax.jit(functools.partial(run, impl="reference")).lower(x).as_text(), formulation
