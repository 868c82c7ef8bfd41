"""The balancing-bias controller: a PID loop on each layer's per-class load error (spec §5, §7 Q6).

ZAYA1 keeps its router busy and balanced with biases that are added to the router probabilities
for top-1 selection only, updated outside the gradient by a "control-theory" rule that the public
sources do not specify. This module implements a positional PID controller per layer and class:

    load_c  = fraction of this step's real tokens routed to class c (E experts + skip)
    target  = (1 - skip_target) / E for every expert, skip_target for the skip class
    e       = target - load                        (positive: the class is under-used)
    I      += e                                     (clamped so |ki * I| <= max_bias: anti-windup)
    bias    = base + kp * e + ki * I + kd * (e - e_prev)

``base`` is the bias the run started from (HF init: 0, and -1 for the skip class). Loads are
global: under ``jit`` the counts are summed over the whole (data-sharded) batch, which is the
all-reduce over data shards.
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
    integral: jax.Array
    prev_error: jax.Array


def init_controller(biases: jax.Array) -> ControllerState:
    """Start the controller from the current balancing biases (layers, E+1)."""
    # Three distinct buffers (copies): a donated train state must not alias any of them.
    return ControllerState(
        base=jnp.array(biases, jnp.float32, copy=True),
        integral=jnp.zeros_like(biases, jnp.float32),
        prev_error=jnp.zeros_like(biases, jnp.float32),
    )


def target_load(num_experts: int, skip_target: float) -> jax.Array:
    """(E+1,) target fractions: uniform over the experts, ``skip_target`` for the skip class."""
    experts = jnp.full((num_experts,), (1.0 - skip_target) / num_experts, jnp.float32)
    return jnp.concatenate([experts, jnp.asarray([skip_target], jnp.float32)])


def update_biases(
    cfg: BalancingConfig, state: ControllerState, load: jax.Array
) -> tuple[jax.Array, ControllerState, jax.Array]:
    """One controller step. load: (layers, E+1) token counts. Returns (biases, state, error)."""
    fraction = load / jnp.maximum(load.sum(axis=-1, keepdims=True), 1.0)
    error = target_load(load.shape[-1] - 1, cfg.skip_target)[None] - fraction
    limit = cfg.max_bias / cfg.ki if cfg.ki > 0 else 0.0
    integral = jnp.clip(state.integral + error, -limit, limit)
    biases = state.base + cfg.kp * error + cfg.ki * integral + cfg.kd * (error - state.prev_error)
    return biases, ControllerState(state.base, integral, error), error
