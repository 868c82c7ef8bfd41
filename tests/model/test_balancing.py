"""The balancing-bias PID controller balances an imbalanced router; without it the imbalance stays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import BalancingConfig
from zaya_jax.model.balancing import (
    init_controller,
    probability_moments,
    probability_spread,
    target_load,
    update_biases,
)
from zaya_jax.model.router import init_balancing_biases

EXPERTS, TOKENS = 8, 1024


def _run(cfg: BalancingConfig, steps: int, controlled: bool = True) -> np.ndarray:
    """A router whose logits favour expert 0 by +2 (token-specific N(0,1) noise on top): ~70% of
    tokens pick expert 0. Selection is argmax(p + bias), as in the model. Returns per-step loads."""
    biases = init_balancing_biases(EXPERTS + 1)[None]
    state = init_controller(biases)

    @jax.jit
    def step(key, biases, state):
        logits = jax.random.normal(key, (TOKENS, EXPERTS + 1)).at[:, 0].add(2.0)
        probs = jax.nn.softmax(logits, axis=-1)
        choice = jnp.argmax(probs + biases[0], axis=-1)
        load = jnp.bincount(choice, length=EXPERTS + 1)[None].astype(jnp.float32)
        moments = probability_moments(probs, jnp.ones((TOKENS,)))
        spread = probability_spread(moments[0][None], moments[1][None], jnp.float32(TOKENS))
        new_biases, new_state, _ = update_biases(cfg, state, biases, load, spread)
        return load[0], new_biases, new_state

    loads = []
    for key in jax.random.split(jax.random.key(0), steps):
        load, new_biases, new_state = step(key, biases, state)
        if controlled:
            biases, state = new_biases, new_state
        loads.append(np.asarray(load))
    return np.stack(loads)


def _max_min_ratio(load: np.ndarray) -> float:
    experts = load[..., :EXPERTS].sum(0)
    return float(experts.max() / max(experts.min(), 1.0))


def test_controller_balances_experts_within_100_steps():
    loads = _run(BalancingConfig(), steps=100)
    assert _max_min_ratio(loads[:1]) > 10  # starts badly imbalanced
    assert _max_min_ratio(loads[-20:]) < 1.2
    assert loads[-20:, EXPERTS].sum() == 0  # the skip target is 0: the skip class stays unused


def test_without_the_controller_the_imbalance_stays():
    loads = _run(BalancingConfig(), steps=150, controlled=False)
    assert _max_min_ratio(loads[-20:]) > 10


def test_skip_target_routes_that_share_of_tokens_to_the_skip_class():
    loads = _run(BalancingConfig(skip_target=0.2), steps=400)  # the skip bias starts at -1
    skip_share = loads[-20:, EXPERTS].sum() / loads[-20:].sum()
    assert skip_share == pytest.approx(0.2, abs=0.04)


def test_target_and_bias_clamp():
    np.testing.assert_allclose(target_load(4, 0.2), [0.2, 0.2, 0.2, 0.2, 0.2])
    cfg = BalancingConfig(kp=0.0, ki=5.0, kd=0.0, max_bias=1.0)
    biases = jnp.zeros((1, 3))
    state = init_controller(biases)
    for _ in range(50):  # class 0 permanently over-loaded: the biases must saturate, not run away
        biases, state, _ = update_biases(cfg, state, biases, jnp.asarray([[10.0, 0.0, 0.0]]), jnp.ones((1,)))
    assert float(jnp.abs(biases).max()) == pytest.approx(1.0)


def test_spread_is_the_token_std_of_probabilities():
    probs = jnp.asarray([[0.5, 0.5], [0.7, 0.3], [0.3, 0.7], [0.9, 0.1]])
    valid = jnp.asarray([1.0, 1.0, 1.0, 0.0])  # the last token is padding
    dev_sum, dev_sq_sum = probability_moments(probs, valid)
    spread = probability_spread(dev_sum[None], dev_sq_sum[None], valid.sum())
    np.testing.assert_allclose(spread, [np.std([0.5, 0.7, 0.3])], rtol=1e-5)


def test_spread_of_a_near_uniform_router_is_exact_and_independent_of_how_tokens_are_split():
    """At initialisation every token sees p ~ 1/C +- 1e-4. Raw float32 sums of p and p^2 cancel
    in E[p^2] - E[p]^2 and give a spread that depends on the summation order (the mesh layout);
    the moments about 1/C give the float64 value, whichever way the tokens are split and summed."""
    classes, tokens = 5, 16384
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 5e-4, (tokens, classes))
    probs64 = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    exact = np.std(probs64, axis=0).mean()
    probs = jnp.asarray(probs64, jnp.float32)
    ones = jnp.ones((tokens,))

    whole = probability_spread(*(m[None] for m in probability_moments(probs, ones)), jnp.float32(tokens))
    # The same tokens as 8 shards summed separately, then added (what a data-parallel mesh does).
    parts = [probability_moments(p, jnp.ones((p.shape[0],))) for p in jnp.split(probs, 8)]
    shards = probability_spread(
        sum(p[0] for p in parts)[None], sum(p[1] for p in parts)[None], jnp.float32(tokens)
    )
    np.testing.assert_allclose(whole, [exact], rtol=1e-4)
    np.testing.assert_allclose(shards, whole, rtol=1e-5)
    # What the raw sums gave: wrong by far more than the tolerance (the defect this guards).
    raw = jnp.sum(probs, 0), jnp.sum(jnp.square(probs), 0)
    naive = probability_spread(raw[0][None], raw[1][None], jnp.float32(tokens))
    assert abs(float(naive[0]) - exact) / exact > 1e-2
