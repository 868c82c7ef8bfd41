"""The CPU custom call for CCA's query/key path (``zaya_jax.ops.cca_cpu``) equals the model's JAX
steps (two-stage convolution, mean residuals, L2 norm, temperature, RoPE) in values and in the
gradients of z and every parameter: documents starting inside and at the edge of its 64-position
chunks, convolutions of other widths, head widths on and off its vector paths, GQA groupings, a
partial rotary width, and all-zero positions (the norm's eps branch). Repeated gradients give the
same bits, and a one-device CPU model runs it (the compiled program holds it)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zaya_jax
from zaya_jax.model.cca import _mean_residuals, _normalized_rotated, two_stage_conv
from zaya_jax.model.rope import inverse_frequencies, rope_tables
from zaya_jax.ops.cca_cpu import BACKWARD, FORWARD, available, cpu_cca_qk
from zaya_jax.parallel import program_hooks

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernel library is not built")

RTOL = 2e-5


def _case(batch=3, seq=150, nq=4, nk=2, d=16, k0=2, k1=2, rotary=None, seed=0):
    rng = np.random.default_rng(seed)
    heads, c = nq + nk, (nq + nk) * d
    f = lambda *shape, s=1.0: jnp.asarray(s * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    weights = (f(k0, c, s=0.5), f(c, s=0.1), f(k1, heads, d, d, s=d**-0.5), f(c, s=0.1))
    temp = jnp.asarray(rng.uniform(0.5, 1.5, nk), jnp.float32)
    rotary = d // 2 if rotary is None else rotary
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    tables = rope_tables(positions, jnp.asarray(inverse_frequencies(10000.0, rotary)), jnp.float32)
    segments = np.ones((batch, seq), np.int32)
    segments[0, 40:], segments[0, 100:] = 2, 3  # documents starting inside chunks
    if batch > 1:
        segments[1, 64:] = 2  # ... and where a chunk starts
    return f(batch, seq, c), weights, temp, tables, jnp.asarray(segments), (nq, nk, d)


def _reference(z, weights, temp, tables, segments, dims):
    nq, nk, d = dims
    batch, seq, _ = z.shape
    cfg = types.SimpleNamespace(num_heads=nq, num_kv_heads=nk, head_dim=d, num_kv_groups=nq // nk)
    conv = two_stage_conv(z, *weights, segments).reshape(batch, seq, nq + nk, d)
    q_res, k_res = _mean_residuals(z[..., : nq * d], z[..., nq * d :], cfg)
    return _normalized_rotated(conv[:, :, :nq] + q_res, conv[:, :, nq:] + k_res, temp, tables)


def _fused(z, weights, temp, tables, segments, dims):
    nq, nk, _ = dims
    return cpu_cca_qk(z, *weights, temp, *tables, segments, nq=nq, nk=nk)


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


def _compare(z, weights, temp, tables, segments, dims, seed=1):
    got, want = (
        jax.jit(_fused, static_argnums=5)(z, weights, temp, tables, segments, dims),
        _reference(z, weights, temp, tables, segments, dims),
    )
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) <= RTOL
    rng = np.random.default_rng(seed)
    cot = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in want]

    def grads(fn):
        def loss(z, weights, temp):
            q, k = fn(z, weights, temp, tables, segments, dims)
            return jnp.sum(q * cot[0]) + jnp.sum(k * cot[1])

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(z, weights, temp)

    got_g, want_g = grads(_fused), grads(_reference)
    names = ["z", "dw_kernel", "dw_bias", "g_kernel", "g_bias", "temp"]
    for name, a, b in zip(names, jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        assert _rel(a, b) <= RTOL, name
    return got_g


def test_equals_the_jax_steps_across_chunks_and_documents():
    _compare(*_case())


@pytest.mark.parametrize(
    ("nq", "nk", "d", "k0", "k1", "rotary"),
    [(4, 2, 32, 2, 2, 16), (4, 4, 24, 3, 2, 8), (6, 2, 8, 2, 4, 8), (2, 1, 64, 4, 3, 0)],
)
def test_groupings_widths_and_convolution_taps(nq, nk, d, k0, k1, rotary):
    _compare(*_case(batch=2, seq=131, nq=nq, nk=nk, d=d, k0=k0, k1=k1, rotary=rotary))


def test_all_zero_positions_take_the_norms_eps_branch():
    z, weights, temp, tables, segments, dims = _case(batch=2, seq=70)
    weights = (weights[0], jnp.zeros_like(weights[1]), weights[2], jnp.zeros_like(weights[3]))
    z = z.at[:, :9].set(0.0)  # the first positions: every head's pre-norm vector is exactly zero
    grads = _compare(z, weights, temp, tables, segments, dims)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_repeated_gradients_give_the_same_bits():
    z, weights, temp, tables, segments, dims = _case(batch=4, seq=300)
    grad = jax.jit(
        jax.grad(lambda z, w: jnp.sum(jnp.sin(_fused(z, w, temp, tables, segments, dims)[0])), (0, 1))
    )
    first = jax.tree.map(np.asarray, grad(z, weights))
    for _ in range(5):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, grad(z, weights)), first)


def test_rejects_other_dtypes():
    z, weights, temp, tables, segments, dims = _case(batch=1, seq=8)
    with pytest.raises(TypeError, match="float32"):
        _fused(z.astype(jnp.bfloat16), weights, temp, tables, segments, dims)


def test_the_handler_names_mismatched_shapes():
    z, weights, temp, tables, segments, (nq, nk, _) = _case(batch=1, seq=8)
    with pytest.raises(Exception, match="nq \\+ nk"):
        jax.block_until_ready(cpu_cca_qk(z, *weights, temp, *tables, segments, nq=nq + 1, nk=nk))


def test_a_one_device_cpu_model_runs_it_and_other_attention_paths_do_not():
    cfg = zaya_jax.load_config("tiny")
    variables = zaya_jax.model.init_variables(cfg.model, 0)
    ids = jnp.ones((2, 80), jnp.int32)

    def text(impl):
        import dataclasses

        model_cfg = dataclasses.replace(cfg.model, attention_impl=impl)
        model = zaya_jax.model.Zaya(model_cfg, program_hooks(model_cfg))
        loss = lambda p: jnp.sum(model.apply({**variables, "params": p}, ids)[0])  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(variables["params"]).as_text()

    fused = text("cpu")
    assert FORWARD in fused and BACKWARD in fused
    assert FORWARD not in text("blocked")
