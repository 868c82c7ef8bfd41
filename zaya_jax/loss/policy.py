"""GRPO's policy-gradient objective (Shao et al. 2024) on sampled rollouts, token-level as in DAPO
(Yu et al. 2025): the clipped importance-weighted surrogate summed over completion tokens, plus
``rl.kl`` times the k3 estimate of KL(pi || reference) (Schulman's unbiased, non-negative
estimator exp(d) - d - 1, d = log ref - log pi), divided by the completion tokens of the batch
(``rl.loss_norm: token``), or each completion's mean over its tokens averaged over the completions
(``sequence``, GRPO's original: a long completion weighs as much as a short one).

Every log-probability is under the distribution the rollouts were sampled from (``rl.temperature``,
``rl.top_k``, ``rl.top_p`` and the tokenizer's vocabulary, :func:`sampling_distribution`), the
sampler's as the trainer's: at temperature 1 the gradient would be another policy's (TRL's fix,
huggingface/trl#3029).

The batch adds per-token fields (:mod:`zaya_jax.objectives.rollouts` builds them): ``sampler_logprobs``
(the sampler's log-probability of each target), ``vocab_limit`` (the ids the sampler could draw),
``advantages`` (the target's completion's
group-normalised advantage), ``reference_logprobs`` when ``rl.kl > 0``, and ``routes`` when the
sampler's routes were captured (replayed with ``rl.replay_routes``, else only compared:
:class:`zaya_jax.model.Zaya`). ``loss_mask`` marks completion tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zaya_jax.config import Config
from zaya_jax.loss.forward import Batch, token_nll
from zaya_jax.model import Zaya


def sampling_distribution(cfg: Config) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) the run's rollouts are sampled from (``rl.*``): the distribution
    whose log-probabilities the ratio, the KL term and every metric use."""
    return (cfg.rl.temperature, cfg.rl.top_k, cfg.rl.top_p)


def grpo_loss_and_stats(
    model: Zaya, params: dict[str, Any], balancing: dict[str, Any], batch: Batch, cfg: Config
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed loss over completion tokens and the statistics to accumulate (``weight`` = completion
    tokens, or completions with ``rl.loss_norm: sequence``, each token weighted by 1 / its
    completion's length; ``sums``: loss, kl, clip_fraction (tokens whose ratio was clipped), ratio,
    sampler_gap (|log pi - log pi_sampler|: nonzero on the first step means the trainer does not
    reproduce the sampler))."""
    rl = cfg.rl
    ce, _, routing = token_nll(
        model, params, balancing, batch, cfg.train.loss_chunk, rl.replay_routes, sampling_distribution(cfg)
    )
    logp = -ce
    mask = batch["loss_mask"].astype(jnp.float32)
    weights = mask  # "token": every completion token counts once
    if rl.loss_norm == "sequence":  # each completion's tokens share one unit of weight
        weights = mask / jnp.maximum(mask.sum(axis=-1, keepdims=True), 1.0)
    advantages = batch["advantages"]
    log_ratio = jnp.where(mask > 0, logp - batch["sampler_logprobs"], 0.0)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - rl.clip_low, 1.0 + rl.clip_high)
    surrogate = -jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped = (ratio * advantages > clipped_ratio * advantages).astype(jnp.float32)
    kl = jnp.zeros_like(logp)
    if "reference_logprobs" in batch:
        d = jnp.where(mask > 0, batch["reference_logprobs"] - logp, 0.0)
        kl = jnp.exp(d) - d - 1.0
    per_token = surrogate + rl.kl * kl

    def total(x: jax.Array) -> jax.Array:
        return jnp.sum(x * weights)

    sums = {
        "loss": total(per_token),
        "kl": total(kl),
        "clip_fraction": total(clipped),
        "ratio": total(ratio),
        "sampler_gap": total(jnp.abs(log_ratio)),
    }
    tokens = mask.sum()
    return sums["loss"], {"weight": weights.sum(), "tokens": tokens, "sums": sums, **routing}
