"""The three MoE compute paths agree (outputs and gradients); the capacity path drops and reports."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.model.experts import (
    blocked_grouped_matmul,
    capacity_experts,
    dense_experts,
    one_hot_capacity_experts,
    sorted_experts,
)

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


def _one_hot_capacity(x, choice, weight, wi, wo, capacity):
    """The one-hot definition's outputs and the drops it implies (a routed token with no slot)."""
    out = one_hot_capacity_experts(x, choice, weight, wi, wo, "silu", capacity)
    routed = jax.nn.one_hot(choice, wi.shape[0], dtype=jnp.int32)
    slot = jnp.cumsum(routed, axis=1) * routed - 1
    return out, (choice < wi.shape[0]) & ((routed * (slot < capacity)).sum(-1) == 0)


@pytest.mark.parametrize("capacity", [1, 3, 7, 30])
def test_expert_major_capacity_equals_the_one_hot_definition(capacity):
    """Outputs, drops and gradients of the gather-based capacity path equal the one-hot einsum
    dispatch, with drops (small capacities), skip tokens and several groups."""
    groups = [_inputs(seed) for seed in range(3)]
    x = jnp.stack([g[0] for g in groups])
    choice = jnp.stack([g[1] for g in groups])
    weight = jnp.stack([g[2] for g in groups])
    _, _, _, wi, wo = groups[0]
    out, dropped = capacity_experts(x, choice, weight, wi, wo, "silu", capacity)
    ref, ref_dropped = _one_hot_capacity(x, choice, weight, wi, wo, capacity)
    np.testing.assert_array_equal(dropped, ref_dropped)
    assert bool(dropped.any()) == (capacity < T // 2)
    np.testing.assert_allclose(out, ref, atol=1e-6)

    def loss(fn, *a):
        return jnp.sum(jnp.sin(fn(*a)[0]))

    ours = jax.grad(lambda x, w, wi, wo: loss(lambda *a: capacity_experts(*a, "silu", capacity), x, choice, w, wi, wo),
                    argnums=(0, 1, 2, 3))(x, weight, wi, wo)  # fmt: skip
    theirs = jax.grad(lambda x, w, wi, wo: loss(lambda *a: _one_hot_capacity(*a, capacity), x, choice, w, wi, wo),
                      argnums=(0, 1, 2, 3))(x, weight, wi, wo)  # fmt: skip
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_the_capacity_path_has_no_tokens_by_experts_by_slots_tensor():
    """The compiled capacity path holds no (groups, tokens, E, C) dispatch tensor: its largest
    buffer is an activation-sized one, not tokens x E x C."""
    groups, tokens, experts, hidden, capacity = 2, 512, 16, 8, 64
    x = jnp.zeros((groups, tokens, hidden))
    choice = jnp.zeros((groups, tokens), jnp.int32)
    wi, wo = jnp.zeros((experts, hidden, 2 * INNER)), jnp.zeros((experts, INNER, hidden))
    compiled = (
        jax.jit(lambda *a: capacity_experts(*a, "silu", capacity))
        .lower(x, choice, x[..., 0], wi, wo)
        .compile()
    )
    one_hot_bytes = groups * tokens * experts * capacity * 4
    assert compiled.memory_analysis().temp_size_in_bytes < one_hot_bytes / 8


def test_capacity_from_config_rounds_up_per_group():
    from zaya_jax.config import ModelConfig

    cfg = ModelConfig(num_experts=16, capacity_factor=1.25)
    assert cfg.capacity(4096) == 320
    assert cfg.capacity(3) == 1


@pytest.mark.parametrize(
    "sizes",
    [
        (0, 0, 0, 0),  # every row past the groups (all skip-routed)
        (200, 0, 3, 64),  # an empty group, a partial block, an exact block; 33 rows past the end
        (300, 0, 0, 0),  # one group takes everything
        (1, 1, 1, 1),
    ],
)
def test_blocked_grouped_matmul_equals_ragged_dot(sizes):
    rows, k, n = 300, 24, 40
    rng = np.random.default_rng(sum(sizes))
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, n)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    probe = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32)

    def loss(fn):
        return jax.jit(
            jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w, group_sizes) * probe), argnums=(0, 1))
        )

    (_, ref_grads), (_, grads) = loss(jax.lax.ragged_dot)(x, w), loss(blocked_grouped_matmul)(x, w)
    forward = jax.jit(blocked_grouped_matmul)(x, w, group_sizes)
    np.testing.assert_allclose(forward, jax.lax.ragged_dot(x, w, group_sizes), atol=1e-4, rtol=1e-5)
    assert np.all(np.asarray(forward)[int(sum(sizes)) :] == 0)  # rows past the groups
    for a, b in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4 * float(jnp.max(jnp.abs(b)) + 1), rtol=0)
