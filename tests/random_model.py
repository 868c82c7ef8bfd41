"""A zaya-jax model whose every parameter is randomised (no HF needed)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import ModelConfig
from zaya_jax.model import init_variables

TINY = ModelConfig(
    vocab_size=61,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_experts=4,
    moe_intermediate_size=24,
    router_hidden_size=8,
    max_position_embeddings=128,
    eos_token_id=1,
)


def tiny_config(**overrides) -> ModelConfig:
    cfg = dataclasses.replace(TINY, **overrides)
    cfg.validate()
    return cfg


@functools.lru_cache(maxsize=16)
def random_variables(cfg: ModelConfig, seed: int = 0) -> dict:
    """Initialise, then move every parameter (temp, scales, biases included) off its constant init.

    Cached per (config, seed): callers must not mutate the returned tree.
    """
    variables = init_variables(cfg, seed)
    rng = np.random.default_rng(seed)

    def perturb(leaf):
        leaf = np.asarray(leaf)
        scale = max(leaf.shape[-2], 1) ** -0.5 if leaf.ndim >= 2 else 0.2
        return jnp.asarray(leaf + scale * rng.standard_normal(leaf.shape).astype(leaf.dtype))

    params = jax.tree.map(perturb, variables["params"])
    # temp starts at 0 (uniform attention); push it well away so q/k actually matter.
    params["layers"]["attn"]["temp"] = params["layers"]["attn"]["temp"] + 1.5
    return {**variables, "params": params}


@functools.lru_cache(maxsize=16)
def varied_variables(cfg: ModelConfig, seed: int = 0) -> dict:
    """:func:`random_variables` with the input and residual-scaling biases zeroed: with them every
    random prompt greedily repeats one token, which would test little of a decoder."""
    variables = random_variables(cfg, seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, leaf: (
            jnp.zeros_like(leaf)
            if getattr(path[-1], "key", "") in ("input_bias", "hidden_bias", "residual_bias")
            else leaf
        ),
        variables["params"],
    )
    return {**variables, "params": params}
