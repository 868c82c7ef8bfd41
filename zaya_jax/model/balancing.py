"""The balancing-bias controller: a PID loop on each layer's per-class load error (spec §5, §7 Q6).

ZAYA1 keeps its router busy and balanced with biases that are added to the router probabilities
for top-1 selection only, updated outside the gradient by a "control-theory" rule that the public
sources do not specify. This module implements an incremental (velocity-form) PID controller per
layer and class:

    load_c   = fraction of this step's real tokens routed to class c (E experts + skip)
    target   = (1 - skip_target) / E for every expert, skip_target for the skip class
    e        = target - load                                   (positive: the class is under-used)
    spread   = std over tokens of the router probabilities, averaged over classes (per layer)
    bias    += spread * (kp * (e - e') + ki * e + kd * (e - 2e' + e''))    e', e'': previous errors

A bias only changes a token's choice relative to the *token-to-token variation* of the
probabilities, so the gains act in units of ``spread``: at initialisation, when every token sees
nearly uniform probabilities (spread ~1e-3), a fixed-size bias would move all tokens to one expert
at once and oscillate; scaled by the spread, the controller splits them instead. Biases stay within
``max_bias`` of where the run started (anti-windup). Loads and spreads are global: under ``jit``
they are sums over the whole (data-sharded) batch, i.e. all-reduced over data shards.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from zaya_jax.config import BalancingConfig


@flax.struct.dataclass
class ControllerState:
    """Per-layer, per-class controller memory; each array is (layers, E+1) float32."""

    base: jax.Array
    prev_error: jax.Array
    prev_prev_error: jax.Array


def init_controller(biases: jax.Array) -> ControllerState:
    """Start the controller from the current balancing biases (layers, E+1)."""
    # Three distinct buffers (copies): a donated train state must not alias any of them.
    return ControllerState(
        base=jnp.array(biases, jnp.float32, copy=True),
        prev_error=jnp.zeros_like(biases, jnp.float32),
        prev_prev_error=jnp.zeros_like(biases, jnp.float32),
    )


def target_load(num_experts: int, skip_target: float) -> jax.Array:
    """(E+1,) target fractions: uniform over the experts, ``skip_target`` for the skip class."""
    experts = jnp.full((num_experts,), (1.0 - skip_target) / num_experts, jnp.float32)
    return jnp.concatenate([experts, jnp.asarray([skip_target], jnp.float32)])


def probability_moments(probs: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sums over real tokens of each class's router probability and its square, both taken about
    the uniform value 1/C: ``(sum valid * (p - 1/C), sum valid * (p - 1/C)^2)``, each (C,) float32.

    probs: (..., C); valid: (...) 1 for real tokens. Shifting first keeps the variance exact:
    a near-uniform router has p ~ 1/C on every token, and raw sums of p and p^2 would cancel
    catastrophically in E[p^2] - E[p]^2 (float32 sums of 10^4 tokens lose the 1e-5 spread to
    rounding, differently for every summation order, i.e. for every mesh layout).
    """
    centred = probs.astype(jnp.float32) - 1.0 / probs.shape[-1]
    valid = valid.astype(jnp.float32)[..., None]
    axes = tuple(range(probs.ndim - 1))
    return jnp.sum(valid * centred, axis=axes), jnp.sum(valid * jnp.square(centred), axis=axes)


def router_entropy_sum(probs: jax.Array, valid: jax.Array) -> jax.Array:
    """Sum over real tokens of the router distribution's entropy (nats), float32: a router that
    sends every token to one class with certainty has 0 (the routing-health alarm's statistic)."""
    p = probs.astype(jnp.float32)
    entropy = -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)
    return jnp.sum(entropy * valid.astype(jnp.float32))


def probability_spread(dev_sum: jax.Array, dev_sq_sum: jax.Array, tokens: jax.Array) -> jax.Array:
    """(layers,) std over tokens of each class's router probability, averaged over classes.

    dev_sum, dev_sq_sum: (layers, C) sums from :func:`probability_moments` (deviations from any
    fixed value give the same variance; deviations from 1/C keep it free of cancellation).
    """
    n = jnp.maximum(tokens, 1.0)
    variance = jnp.maximum(dev_sq_sum / n - jnp.square(dev_sum / n), 0.0)
    return jnp.sqrt(variance).mean(axis=-1)


def update_biases(
    cfg: BalancingConfig, state: ControllerState, biases: jax.Array, load: jax.Array, spread: jax.Array
) -> tuple[jax.Array, ControllerState, jax.Array]:
    """One controller step. biases, load: (layers, E+1); spread: (layers,). Returns (biases, state, error)."""
    fraction = load / jnp.maximum(load.sum(axis=-1, keepdims=True), 1.0)
    error = target_load(load.shape[-1] - 1, cfg.skip_target)[None] - fraction
    e1, e2 = state.prev_error, state.prev_prev_error
    delta = cfg.kp * (error - e1) + cfg.ki * error + cfg.kd * (error - 2 * e1 + e2)
    new = biases + spread[:, None] * delta
    new = jnp.clip(new, state.base - cfg.max_bias, state.base + cfg.max_bias)
    return new, ControllerState(state.base, error, e1), error
