"""Parameter counts computed from shapes only (``jax.eval_shape``: no memory is allocated)."""

from __future__ import annotations

import math

import jax

from zaya_jax.config import ModelConfig
from zaya_jax.model.transformer import abstract_variables


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """``total_params``, ``non_embedding_params`` and ``active_params`` (per token, non-embedding).

    The embedding (and an untied LM head) are the embedding parameters. A token runs one of the E
    experts (top-1), so (E-1)/E of the expert stack is inactive; the skip class runs none, which is
    not counted as savings. Buffers (the balancing biases) are not parameters.
    """
    params = abstract_variables(cfg)["params"]
    size = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
    total = size(params)
    embedding = (
        size(params["embedding"]) + size(params.get("lm_head", {})) + size(params.get("lm_head_bias", {}))
    )
    experts = size(params["layers"]["experts"])
    non_embedding = total - embedding
    inactive = experts * (cfg.num_experts - 1) // cfg.num_experts
    return {
        "total_params": total,
        "non_embedding_params": non_embedding,
        "active_params": non_embedding - inactive,
    }


def short_count(n: int) -> str:
    """``n`` for a person: 1.9M, 673.4K, 12."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
