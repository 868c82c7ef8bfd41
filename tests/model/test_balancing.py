"""The balancing-bias PID controller balances an imbalanced router; without it the imbalance stays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import BalancingConfig
from zaya_jax.model.balancing import init_controller, probability_spread, target_load, update_biases
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
        spread = probability_spread(probs.sum(0)[None], jnp.square(probs).sum(0)[None], jnp.float32(TOKENS))
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
    probs = jnp.asarray([[0.5, 0.5], [0.7, 0.3], [0.3, 0.7]])
    spread = probability_spread(probs.sum(0)[None], jnp.square(probs).sum(0)[None], jnp.float32(3))
    np.testing.assert_allclose(spread, [np.std([0.5, 0.7, 0.3])], rtol=1e-5)
