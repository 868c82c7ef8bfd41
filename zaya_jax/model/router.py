"""The ZAYA1 router: down-projection, exponential depth averaging (EDA), RMSNorm, 3-layer MLP,
softmax over E+1 classes, balancing biases for selection only (spec §2.4).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from zaya_jax.model.layers import Dense
from zaya_jax.model.norms import RMSNorm

BALANCING = "balancing"
"""The non-gradient variable collection holding the per-layer balancing biases (E+1,)."""


def init_balancing_biases(num_classes: int) -> jax.Array:
    """HF init: 0 for every expert, -1 for the skip class (so a fresh model never skips)."""
    return jnp.zeros((num_classes,), jnp.float32).at[-1].set(-1.0)


class Routing(NamedTuple):
    probs: jax.Array  # (batch, seq, E+1) softmax in the compute dtype
    choice: jax.Array  # (batch, seq) int32 in [0, E]; E is the MOD skip class
    weight: jax.Array  # (batch, seq) unbiased, un-renormalised prob of the chosen class
    state: jax.Array  # (batch, seq, R) post-EDA, pre-norm router state passed to the next block
    natural: jax.Array  # (batch, seq) int32: the biased argmax, the class chosen without replay


class Router(nn.Module):
    """m: (batch, seq, embed) normed MoE input; prev_state: (batch, seq, R); eda_scale: (R,).

    Block 0 gets prev_state = 0 and eda_scale = 0, which adds an exact zero: it has no EDA.

    ``forced`` (batch, seq) int32, optional: router replay. Where it is >= 0 the class it names is
    selected instead of the biased argmax (a route captured by a sampler); the probabilities, and so
    the chosen class's weight and the router's gradient, are computed as always. -1: route normally.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self, m: jax.Array, prev_state: jax.Array, eda_scale: jax.Array, forced: jax.Array | None = None
    ) -> Routing:
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        width, classes, std = cfg.router_hidden_size, cfg.num_experts + 1, cfg.initializer_range

        state = Dense(width, ("embed", "router"), True, std, dtype, pdtype, name="down")(m)
        state = state + eda_scale.astype(dtype) * prev_state.astype(dtype)
        u = RMSNorm(cfg.rms_norm_eps, "router", dtype, pdtype, name="norm")(state)
        u = nn.gelu(
            Dense(width, ("router", "router_mlp"), True, std, dtype, pdtype, name="fc1")(u), approximate=False
        )
        u = nn.gelu(
            Dense(width, ("router_mlp", "router"), True, std, dtype, pdtype, name="fc2")(u), approximate=False
        )
        logits = Dense(classes, ("router", "router_classes"), False, std, dtype, pdtype, name="out")(u)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)

        biases = self.variable(
            BALANCING,
            "biases",
            nn.with_logical_partitioning(lambda: init_balancing_biases(classes), ("router_classes",)),
        ).value
        # Biases shift *probabilities* for top-1 selection only; no gradient flows through the choice.
        natural = jnp.argmax(jax.lax.stop_gradient(probs).astype(jnp.float32) + biases, axis=-1).astype(
            jnp.int32
        )
        choice = natural if forced is None else jnp.where(forced >= 0, forced.astype(jnp.int32), natural)
        weight = jnp.take_along_axis(probs, choice[..., None], axis=-1)[..., 0]
        return Routing(probs, choice, weight, state, natural)
