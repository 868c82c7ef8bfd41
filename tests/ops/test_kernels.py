"""The CPU custom calls equal their pure-JAX references: forward, gradients, vmap, odd shapes,
float32 and bfloat16; the model and Muon give the same numbers with the kernels selected."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.kernel_cases import _inputs, _rel
from tests.random_model import random_variables, tiny_config
from zaya_jax import ops
from zaya_jax.config import NS_COEFFS
from zaya_jax.model import Zaya
from zaya_jax.model.mesh_hooks import ModelHooks
from zaya_jax.ops.kernel_plan import resolve_kernel_plan

# bfloat16: the kernels round after every bf16 op, as the reference's program is written; XLA by
# default may skip those roundings (xla_allow_excess_precision), which moves gradients by up to
# ~10% of the largest entry on unlucky elements. Exact bf16 agreement, with that flag off, is
# checked in tests/ops/test_kernels_sharded.py; here bf16 gets the forward check only.
TOL = {jnp.float32: (2e-6, 2e-6), jnp.bfloat16: (1e-2, None)}  # (forward, gradient), relative to max


def test_cpu_kernels_are_registered():
    status = ops.kernel_status()
    assert status["cpu"] == "registered", status


def test_a_rocm_library_without_the_devices_target_is_not_used(tmp_path, monkeypatch):
    """A gfx90a-only library on a gfx942 device (MI300X) would fail at its first launch: it is
    reported unusable with the rebuild command, and the pure-JAX reference runs instead."""
    from zaya_jax.ops import _registry

    (tmp_path / "build.json").write_text('{"rocm": {"archs": ["gfx90a"], "device_code_only": ["gfx942"]}}')
    monkeypatch.setattr(_registry, "LIB_DIR", tmp_path)
    monkeypatch.setattr(_registry, "_status", {"rocm": "registered", "cpu": "registered"})
    device = type("Device", (), {"compute_capability": "gfx942:sramecc+:xnack-"})()
    monkeypatch.setattr(_registry.jax, "devices", lambda platform=None: [device])
    _registry.arch_mismatch.cache_clear()
    try:
        assert not _registry.registered("rocm")
        assert "this device is gfx942" in _registry.arch_mismatch("rocm")
        assert "ZAYA_HIP_ARCHS=gfx942" in _registry.arch_mismatch("rocm")
        device.compute_capability = "gfx90a"
        _registry.arch_mismatch.cache_clear()
        assert _registry.registered("rocm")
    finally:
        _registry.arch_mismatch.cache_clear()


def _uses_custom_call(fn, *args):
    return "zaya_residual_rms_norm" in jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 9, 64), (7, 33), (1, 1, 1, 130)])
def test_residual_norm_forward_and_gradients_equal_the_reference(dtype, shape):
    f, h, params = _inputs(shape, dtype)
    fwd_tol, grad_tol = TOL[dtype]

    def run(impl):
        return ops.residual_rms_norm(f, h, *params, eps=1e-5, impl=impl)

    assert _uses_custom_call(lambda f: ops.residual_rms_norm(f, h, *params, eps=1e-5), f)
    for out, ref in zip(jax.jit(lambda: run("custom"))(), run("reference"), strict=True):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert _rel(out, ref) <= fwd_tol

    def loss(impl):
        def fn(f, h, *p):
            h_new, y = ops.residual_rms_norm(f, h, *p, eps=1e-5, impl=impl)
            y = y.astype(jnp.float32)
            return jnp.sum(jnp.sin(h_new)) + jnp.sum(y * jnp.cos(y))

        return jax.jit(jax.grad(fn, argnums=tuple(range(7))))

    if grad_tol is None:
        return
    grads, ref = loss("custom")(f, h, *params), loss("reference")(f, h, *params)
    for g, r in zip(grads, ref, strict=True):
        assert g.dtype == r.dtype
        assert _rel(g, r) <= grad_tol


def test_residual_norm_under_vmap_with_batched_and_unbatched_parameters():
    f, h, params = _inputs((3, 5, 48), jnp.float32)
    weights = jnp.stack([params[4], 2 * params[4], -params[4]])  # one norm weight per vmapped row

    def apply(impl):
        def one(f, h, w):
            return ops.residual_rms_norm(f, h, *params[:4], w, eps=1e-5, impl=impl)

        return jax.jit(jax.vmap(one))(f, h, weights)

    for out, ref in zip(apply("custom"), apply("reference"), strict=True):
        assert _rel(out, ref) <= 2e-6
    grad = jax.vmap(jax.grad(lambda f, h: jnp.sum(ops.residual_rms_norm(f, h, *params, eps=1e-5)[1] ** 2)))
    ref = jax.vmap(
        jax.grad(
            lambda f, h: jnp.sum(ops.residual_rms_norm(f, h, *params, eps=1e-5, impl="reference")[1] ** 2)
        )
    )
    assert _rel(jax.jit(grad)(f, h), ref(f, h)) <= 2e-6


def test_residual_norm_rejects_mismatched_inputs():
    f, h, params = _inputs((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="same shape"):
        ops.residual_rms_norm(f, h[:1], *params, eps=1e-5)
    with pytest.raises(ValueError, match="unknown impl"):
        ops.residual_rms_norm(f, h, *params, eps=1e-5, impl="fast")


@pytest.mark.parametrize("shape", [(3, 24, 56), (1, 17, 17), (2, 2, 5, 9)])
def test_newton_schulz_equals_the_reference_and_vmaps(shape):
    x = jax.random.normal(jax.random.key(1), shape)
    x = x / jnp.linalg.norm(x, axis=(-2, -1), keepdims=True)
    coeffs = NS_COEFFS
    fn = jax.jit(lambda x: ops.newton_schulz_iterations(x, 5, coeffs))
    assert "zaya_newton_schulz" in fn.lower(x).as_text()
    ref = ops.newton_schulz_iterations(x, 5, coeffs, impl="reference")
    assert _rel(fn(x), ref) <= 1e-5
    vmapped = jax.jit(jax.vmap(lambda m: ops.newton_schulz_iterations(m, 5, coeffs)))(x)
    assert _rel(vmapped, ref) <= 1e-5
    with pytest.raises(ValueError, match="m <= n"):
        ops.newton_schulz_iterations(
            jnp.swapaxes(x, -1, -2) if shape[-2] < shape[-1] else x[..., :1], 5, coeffs
        )


def test_model_with_kernels_matches_the_reference_model():
    cfg = tiny_config()
    variables = random_variables(cfg, seed=3)
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)

    def loss(model):
        def fn(params):
            logits, _ = model.apply({**variables, "params": params}, tokens)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 1])

        return jax.jit(jax.value_and_grad(fn))

    plan = resolve_kernel_plan(dataclasses.replace(cfg, kernels="kernel"))
    assert plan.norm == "kernel"
    custom = Zaya(cfg, ModelHooks(kernels=plan))
    reference = Zaya(cfg, ModelHooks(kernels=dataclasses.replace(plan, norm="jax")))  # the norm alone differs
    assert "zaya_residual_rms_norm_fwd" in loss(custom).lower(variables["params"]).as_text()
    assert "zaya_residual_rms_norm_fwd" not in loss(reference).lower(variables["params"]).as_text()
    (l_c, g_c), (l_r, g_r) = loss(custom)(variables["params"]), loss(reference)(variables["params"])
    np.testing.assert_allclose(l_c, l_r, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_r), strict=True):
        assert _rel(a, b) <= 1e-5


def test_muon_with_kernels_matches_the_reference():
    from zaya_jax.optim.muon import orthogonalize

    x = jax.random.normal(jax.random.key(4), (2, 3, 40, 24))  # tall: iterates on the transpose
    ref = orthogonalize(x, (2, 3), formulation="standard")
    out = jax.jit(lambda x: orthogonalize(x, (2, 3), impl="kernel", formulation="standard"))(x)
    assert _rel(out, ref) <= 1e-5
