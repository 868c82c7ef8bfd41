"""The CPU Newton-Schulz custom call (``zaya_jax.ops.newton_schulz_cpu``) against the JAX loop of the
same formulation (``newton_schulz_iterations(impl="reference")``, what GPUs run) and the float64
iteration: Gaussian, low-rank and ill-conditioned matrices, shapes on and off its 8 x 32 tiles and
32-blocks, both formulations and every restart. Each matrix's bits do not depend on its batch (a
device's share of a stack gives the whole stack's bits) nor on the call; Muon's default update on a
CPU runs it, one call per leaf, and the GPU program does not."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zaya_jax
from zaya_jax.config import NS_COEFFS
from zaya_jax.ops.kernel_plan import resolve_kernel_plan
from zaya_jax.ops.newton_schulz import newton_schulz_gram_reference, newton_schulz_iterations
from zaya_jax.ops.newton_schulz_cpu import TARGET, available, cpu_newton_schulz, flops, resolve
from zaya_jax.ops.platform import planning_for
from zaya_jax.optim import build_optimizer, model_param_groups, newton_schulz

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernel library is not built")

# Measured over these shapes and inputs: the kernel is <= 1.1e-5 (standard) and <= 2.2e-5 (gram)
# off the JAX loop in relative Frobenius norm, max |dX| <= 2.5e-5 (8 x 8); each is as far from the
# float64 iteration as the loop is (<= 3.5e-5). A wrong coefficient, a missed block or a symmetrised
# restart product (the ~1e-3 mistake the kernel's comment names) is far past these.
REL_FRO_BOUND = 5e-5
MAX_ABS_BOUND = 5e-5
SHAPES = [(4, 128, 512), (4, 128, 256), (2, 128, 128), (4, 64, 128), (3, 40, 100), (2, 33, 70), (2, 8, 8)]


def _normalised(kind: str, shape: tuple[int, int, int], seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    batch, m, n = shape
    if kind == "gaussian":
        x = rng.standard_normal(shape)
    elif kind == "low_rank":
        r = max(1, m // 8)
        x = rng.standard_normal((batch, m, r)) @ rng.standard_normal((batch, r, n))
        x = x + 0.01 * np.sqrt(r) * rng.standard_normal(shape)
    else:  # singular values log-spaced over 1e-4..1
        u = np.linalg.qr(rng.standard_normal((batch, m, m)))[0]
        v = np.linalg.qr(rng.standard_normal((batch, n, m)))[0]
        x = (u * np.logspace(-4, 0, m)) @ np.swapaxes(v, -1, -2)
    return jnp.asarray(x / np.linalg.norm(x, axis=(-2, -1), keepdims=True), jnp.float32)


def _float64(x: jax.Array, steps: int = 5) -> np.ndarray:
    a, b, c = NS_COEFFS
    x = np.asarray(x, np.float64)
    for _ in range(steps):
        g = x @ np.swapaxes(x, -1, -2)
        x = a * x + (b * g + c * g @ g) @ x
    return x


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("formulation", ["standard", "gram"])
@pytest.mark.parametrize("kind", ["gaussian", "low_rank", "ill_conditioned"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_equals_the_jax_loop_of_the_same_formulation(shape, kind, formulation):
    x = _normalised(kind, shape, seed=shape[1] + shape[2])
    ours = cpu_newton_schulz(x, 5, NS_COEFFS, formulation)
    loop = newton_schulz_iterations(x, 5, NS_COEFFS, impl="reference", formulation=formulation)
    assert _rel(ours, loop) < REL_FRO_BOUND
    assert float(jnp.max(jnp.abs(ours - loop))) < MAX_ABS_BOUND
    exact = _float64(x)
    assert _rel(ours, exact) < max(2 * _rel(loop, exact), 1e-5), (_rel(ours, exact), _rel(loop, exact))


@pytest.mark.parametrize("steps, restart", [(1, 3), (2, 3), (5, 1), (5, 2), (5, 3), (5, 5), (7, 3)])
def test_every_restart_equals_the_jax_gram_iteration(steps, restart):
    x = _normalised("low_rank", (3, 64, 192))
    a, b, c = NS_COEFFS
    ours = cpu_newton_schulz(x, steps, NS_COEFFS, "gram", restart=restart)
    loop = newton_schulz_gram_reference(x, steps, a, b, c, restart=restart)
    exact = _float64(x, steps)  # without a restart within 5 steps both drift to ~2.5e-4 of it
    assert _rel(ours, exact) < max(2 * _rel(loop, exact), 1e-5), (_rel(ours, exact), _rel(loop, exact))


def test_auto_takes_the_cheaper_formulation():
    # tiny's leaves: experts wi 128 x 512 and wo (transposed) 128 x 256 iterate on the Gram matrix,
    # the square q/o projections on X.
    assert [resolve("auto", 128, n, 5) for n in (128, 256, 512)] == ["standard", "gram", "gram"]
    assert flops(128, 512, 5, "gram") < 0.65 * flops(128, 512, 5, "standard")
    # 32-blocks on and above the diagonal: 10 of 16 at m = 128, the whole matrix below one block
    assert flops(128, 128, 1, "standard") == 2 * (2 * 128 * 128 * 80) + 2 * 128**3
    assert flops(16, 40, 1, "standard") == 2 * (16 * 16 * 40 + 16 * 16 * 16 + 16 * 16 * 40)
    x = _normalised("gaussian", (2, 128, 256))
    np.testing.assert_array_equal(
        cpu_newton_schulz(x, 5, NS_COEFFS), cpu_newton_schulz(x, 5, NS_COEFFS, "gram")
    )


def test_a_matrix_has_the_same_bits_in_any_batch_and_on_every_call():
    x = _normalised("ill_conditioned", (6, 64, 160))
    whole = np.asarray(cpu_newton_schulz(x, 5, NS_COEFFS))
    for i in (0, 3, 5):
        np.testing.assert_array_equal(np.asarray(cpu_newton_schulz(x[i : i + 1], 5, NS_COEFFS))[0], whole[i])
    np.testing.assert_array_equal(np.asarray(cpu_newton_schulz(x[2:5], 5, NS_COEFFS)), whole[2:5])
    busy = threading.Event()

    def load():  # another thread keeps XLA's pool busy meanwhile
        while not busy.is_set():
            jax.block_until_ready(jnp.ones((256, 256)) @ jnp.ones((256, 256)))

    thread = threading.Thread(target=load)
    thread.start()
    try:
        fn = jax.jit(lambda x: cpu_newton_schulz(x, 5, NS_COEFFS))
        for _ in range(4):
            np.testing.assert_array_equal(np.asarray(fn(x)), whole)
    finally:
        busy.set()
        thread.join()


def test_vmap_and_the_gradient_go_through_the_jax_loop():
    x = jnp.stack([_normalised("gaussian", (3, 16, 48), seed) for seed in (0, 1)])  # vmapped over axis 0
    vmapped = jax.vmap(lambda x: cpu_newton_schulz(x, 5, NS_COEFFS, "standard"))(x)
    np.testing.assert_array_equal(vmapped, cpu_newton_schulz(x, 5, NS_COEFFS, "standard"))
    weights = jax.random.normal(jax.random.key(1), x.shape[1:])  # a linear loss: the same cotangent
    loss = lambda f: lambda x: jnp.vdot(weights, f(x))  # noqa: E731
    ours = jax.grad(loss(lambda x: cpu_newton_schulz(x, 5, NS_COEFFS, "gram")))(x[0])
    loop = jax.grad(
        loss(lambda x: newton_schulz_iterations(x, 5, NS_COEFFS, impl="reference", formulation="gram"))
    )
    np.testing.assert_allclose(ours, loop(x[0]), rtol=1e-6, atol=1e-6)


def test_bad_input_is_refused_with_what_to_change():
    x = _normalised("gaussian", (2, 16, 32))
    with pytest.raises(ValueError, match="m <= n"):
        cpu_newton_schulz(jnp.swapaxes(x, -1, -2), 5, NS_COEFFS)
    with pytest.raises(ValueError, match="float32"):
        cpu_newton_schulz(x.astype(jnp.bfloat16), 5, NS_COEFFS)
    with pytest.raises(ValueError, match="restart"):
        cpu_newton_schulz(x, 5, NS_COEFFS, "gram", restart=0)
    with pytest.raises(ValueError, match="formulation"):
        cpu_newton_schulz(x, 5, NS_COEFFS, "fast")
    np.testing.assert_array_equal(cpu_newton_schulz(x, 0, NS_COEFFS), x)  # no step: X itself


def test_muon_on_a_cpu_runs_it_per_leaf_and_the_gpu_program_does_not():
    cfg = zaya_jax.load_config("tiny")
    groups = model_param_groups(cfg.model, cfg.optim.router_group)
    params = zaya_jax.model.init_variables(cfg.model, 0)["params"]
    muon = sum(g.group == "muon" for g in jax.tree.leaves(groups, is_leaf=lambda g: hasattr(g, "group")))

    def text():  # the optimizer of the kernel plan resolved for the program (auto)
        plan = resolve_kernel_plan(cfg.model, cfg.optim.kernels)
        tx = build_optimizer(cfg.optim, groups, 100, newton_schulz=plan.newton_schulz)
        return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)).lower(params, params).as_text()

    assert text().count(f"@{TARGET}(") == muon
    with planning_for("gpu"):
        assert TARGET not in text()
    # newton_schulz takes it for tall matrices too (on their transpose), equal to the JAX loop
    tall = jax.random.normal(jax.random.key(0), (4, 256, 128))
    kernel = newton_schulz(tall, impl="kernel")
    assert _rel(kernel, newton_schulz(tall, impl="jax", formulation="gram")) < REL_FRO_BOUND
