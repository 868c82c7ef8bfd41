"""The three MoE compute paths agree (outputs and gradients); the capacity path drops and reports."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.model.experts import capacity_experts, dense_experts, sorted_experts

E, H, INNER, T = 4, 8, 6, 24


def _inputs(seed=0, skip_fraction=0.25):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    choice = rng.integers(0, E, size=T)
    choice[rng.random(T) < skip_fraction] = E  # the MOD skip class
    weight = jnp.asarray(rng.random(T), jnp.float32)
    wi = jnp.asarray(rng.standard_normal((E, H, 2 * INNER)) / np.sqrt(H), jnp.float32)
    wo = jnp.asarray(rng.standard_normal((E, INNER, H)) / np.sqrt(INNER), jnp.float32)
    return x, jnp.asarray(choice, jnp.int32), weight, wi, wo


def _capacity(x, choice, weight, wi, wo, capacity):
    out, dropped = capacity_experts(x[None], choice[None], weight[None], wi, wo, "silu", capacity)
    return out[0], dropped[0]


def test_sorted_and_capacity_equal_dense_when_nothing_is_dropped():
    x, choice, weight, wi, wo = _inputs()
    ref = dense_experts(x, choice, weight, wi, wo, "silu")
    np.testing.assert_allclose(sorted_experts(x, choice, weight, wi, wo, "silu"), ref, atol=1e-6)
    out, dropped = _capacity(x, choice, weight, wi, wo, capacity=T)
    np.testing.assert_allclose(out, ref, atol=1e-6)
    assert not dropped.any()


def test_skip_tokens_get_exactly_zero_from_every_path():
    x, choice, weight, wi, wo = _inputs(skip_fraction=0.5)
    skip = np.asarray(choice) == E
    assert skip.any()
    for out in (
        dense_experts(x, choice, weight, wi, wo, "silu"),
        sorted_experts(x, choice, weight, wi, wo, "silu"),
        _capacity(x, choice, weight, wi, wo, capacity=T)[0],
    ):
        assert np.all(np.asarray(out)[skip] == 0)


@pytest.mark.parametrize("path", ["sorted", "capacity"])
def test_gradients_equal_the_dense_reference(path):
    x, choice, weight, wi, wo = _inputs(seed=1)

    def loss(fn, x, weight, wi, wo):
        return jnp.sum(jnp.sin(fn(x, choice, weight, wi, wo)))

    fn = sorted_experts if path == "sorted" else lambda *a: _capacity(*a, capacity=T)[0]
    dense = lambda x, c, w, wi, wo: dense_experts(x, c, w, wi, wo, "silu")  # noqa: E731
    other = (lambda x, c, w, wi, wo: fn(x, c, w, wi, wo, "silu")) if path == "sorted" else fn
    g_ref = jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2, 3))(x, weight, wi, wo)
    g = jax.grad(lambda *a: loss(other, *a), argnums=(0, 1, 2, 3))(x, weight, wi, wo)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_capacity_path_drops_overflow_tokens_in_arrival_order_and_reports_them():
    x, _, weight, wi, wo = _inputs()
    choice = jnp.zeros((T,), jnp.int32).at[-3:].set(1)  # 21 tokens want expert 0, 3 want expert 1
    out, dropped = _capacity(x, choice, weight, wi, wo, capacity=5)
    dropped = np.asarray(dropped)
    assert dropped.sum() == 21 - 5
    assert not dropped[:5].any() and dropped[5:21].all() and not dropped[21:].any()
    assert np.all(np.asarray(out)[dropped] == 0)
    ref = dense_experts(x, choice, weight, wi, wo, "silu")
    np.testing.assert_allclose(np.asarray(out)[~dropped], np.asarray(ref)[~dropped], atol=1e-6)


def test_capacity_from_config_rounds_up_per_group():
    from zaya_jax.config import ModelConfig

    cfg = ModelConfig(num_experts=16, capacity_factor=1.25)
    assert cfg.capacity(4096) == 320
    assert cfg.capacity(3) == 1
