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

Three policies meet here: the sampler's (``pi_sampler``, the behaviour policy, whose
log-probabilities the rollouts carry), the trainer's at the rollout's parameters (``pi_old``, the
proximal policy) and the one being trained (``pi``). Without a correction (the default) the ratio
is pi / pi_sampler: zaya's own sampler reproduces the trainer (``sampler_gap`` ~1e-7), so
pi_sampler is pi_old. With ``rl.tis_cap`` or ``rl.tis_mask`` (rollouts from another engine, or
from parameters older than the step's), the ratio is pi / pi_old and each token's surrogate is
weighted by w = pi_old / pi_sampler (the decoupled objective of AReaL, the truncated importance
sampling of verl and TRL's ``vllm_importance_sampling_mode``): per token, or per completion as the
product over its tokens (``rl.tis_level``), truncated above at ``tis_cap`` (TIS) and set to 0
outside [1 / ``tis_mask``, ``tis_mask``] (MIS), never differentiated. pi_old is the trainer's
log-probability itself, not differentiated, when each rollout trains one step; with
``rl.steps_per_rollout > 1`` the rollout's rows carry it (``proximal_logprobs``, one forward pass
at the rollout's parameters). ``rl.ratio: sequence`` is GSPO's ratio (Zheng et al. 2025): one per
completion, exp of the mean over its tokens of log pi - log pi_old, clipped as a whole.

The batch adds per-token fields (:mod:`zaya_jax.objectives.rollouts` builds them): ``sampler_logprobs``
(the sampler's log-probability of each target), ``vocab_limit`` (the ids the sampler could draw),
``advantages`` (the target's completion's group-normalised advantage), ``reference_logprobs`` when
``rl.kl > 0``, ``proximal_logprobs`` (above), and ``routes`` when the sampler's routes were
captured (replayed with ``rl.replay_routes``, else only compared: :class:`zaya_jax.model.Zaya`).
``loss_mask`` marks completion tokens; a completion is a segment of its row (``segment_ids``).

Besides the loss, a step reports how far the trainer is from the sampler over completion tokens
(:func:`policy_terms`): ``sampler_gap`` (mean |log pi - log pi_sampler|), ``mismatch_kl`` (the k3
estimate of KL(pi_sampler || pi)), ``mismatch_chi2`` (E[rho^2] - 1, rho = pi / pi_sampler: the
variance an importance weight adds), ``max_ratio`` and ``min_ratio`` (rho's extremes), and with a
correction ``tis_truncated`` and ``tis_masked`` (the share of tokens whose weight was truncated or
masked).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zaya_jax.config import Config, RLConfig
from zaya_jax.loss.forward import Batch, segment_sums, token_nll
from zaya_jax.model import Zaya


def sampling_distribution(cfg: Config) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) the run's rollouts are sampled from (``rl.*``): the distribution
    whose log-probabilities the ratio, the KL term and every metric use."""
    return (cfg.rl.temperature, cfg.rl.top_k, cfg.rl.top_p)


def _completion_sums(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Each token's completion's sum of ``values`` (a completion: a segment of its row), per token."""
    return jnp.take_along_axis(segment_sums(values, segment_ids), segment_ids, axis=1)


def importance_weights(
    proximal: jax.Array, sampler: jax.Array, mask: jax.Array, segment_ids: jax.Array, rl: RLConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(w, truncated, masked) per token: the weight pi_old / pi_sampler of each completion token
    (of its completion with ``rl.tis_level: sequence``), truncated at ``rl.tis_cap`` and 0 outside
    [1 / ``rl.tis_mask``, ``rl.tis_mask``]; ``truncated`` and ``masked`` (0/1) mark the tokens each
    bound changed. 1 everywhere without a correction."""
    log_w = jnp.where(mask > 0, proximal - sampler, 0.0)
    if rl.tis_level == "sequence":  # the product over the completion's tokens
        log_w = jnp.where(mask > 0, _completion_sums(log_w, segment_ids), 0.0)
    w = jnp.exp(log_w)
    kept = jnp.ones_like(w, dtype=bool)
    if rl.tis_mask > 0:
        kept = (log_w >= -jnp.log(rl.tis_mask)) & (log_w <= jnp.log(rl.tis_mask))
    truncated = jnp.zeros_like(w, dtype=bool)
    if rl.tis_cap > 0:
        truncated = kept & (w > rl.tis_cap)
        w = jnp.minimum(w, rl.tis_cap)
    w = jnp.where(kept, w, 0.0)  # an overflowed product (inf) is masked or truncated, never inf * 0
    on = mask > 0
    return w, (truncated & on).astype(jnp.float32), (~kept & on).astype(jnp.float32)


def policy_terms(
    logp: jax.Array, batch: Batch, rl: RLConfig
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
    """(per-token loss, per-token weight, per-token statistics, extremes) of GRPO's objective given
    the trainer's log-probability ``logp`` (batch, seq) of every target: the loss is
    ``sum(loss * weight)``; each statistic is summed the same way (``weight``: 1 per completion
    token, or 1 / its completion's length with ``rl.loss_norm: sequence``); ``extremes`` maps
    ``max_ratio`` and ``min_ratio`` to their values over the batch's completion tokens."""
    mask = batch["loss_mask"].astype(jnp.float32)
    segments = batch["segment_ids"]
    on = mask > 0
    weights = mask  # "token": every completion token counts once
    # each completion's token count, for the per-completion norm and GSPO's mean only
    needs_lengths = rl.loss_norm == "sequence" or rl.ratio == "sequence"
    lengths = _completion_sums(mask, segments) if needs_lengths else None
    if rl.loss_norm == "sequence":  # each completion's tokens share one unit of weight
        weights = mask / jnp.maximum(lengths, 1.0)
    sampler = batch["sampler_logprobs"]
    if rl.corrected:  # the ratio against pi_old, the sampler corrected by importance weights
        proximal = batch.get("proximal_logprobs", jax.lax.stop_gradient(logp))
        w, truncated, masked = importance_weights(proximal, sampler, mask, segments, rl)
    else:
        proximal, w = sampler, 1.0
    log_ratio = jnp.where(on, logp - proximal, 0.0)
    if rl.ratio == "sequence":  # GSPO: the completion's mean log-ratio, for each of its tokens
        log_ratio = jnp.where(on, _completion_sums(log_ratio, segments) / jnp.maximum(lengths, 1.0), 0.0)
    ratio = jnp.exp(log_ratio)
    advantages = batch["advantages"]
    clipped_ratio = jnp.clip(ratio, 1.0 - rl.clip_low, 1.0 + rl.clip_high)
    surrogate = -jnp.minimum(ratio * advantages, clipped_ratio * advantages) * w
    clipped = (ratio * advantages > clipped_ratio * advantages).astype(jnp.float32)
    kl = jnp.zeros_like(logp)
    if "reference_logprobs" in batch:
        d = jnp.where(on, batch["reference_logprobs"] - logp, 0.0)
        kl = jnp.exp(d) - d - 1.0
    # the trainer against the sampler, as measured (not differentiated)
    gap = jnp.where(on, jax.lax.stop_gradient(logp) - sampler, 0.0)
    rho = jnp.exp(gap)
    stats = {
        "kl": kl,
        "clip_fraction": clipped,
        "ratio": ratio,
        "sampler_gap": jnp.abs(gap),
        "mismatch_kl": rho - 1.0 - gap,
        "mismatch_chi2": rho * rho - 1.0,
    }
    if rl.corrected:
        stats |= {"tis_truncated": truncated, "tis_masked": masked}
    extremes = {
        "max_ratio": jnp.max(jnp.where(on, rho, 0.0)),
        "min_ratio": jnp.min(jnp.where(on, rho, jnp.inf)),
    }
    return surrogate + rl.kl * kl, weights, stats, extremes


def grpo_loss_and_stats(
    model: Zaya, params: dict[str, Any], balancing: dict[str, Any], batch: Batch, cfg: Config
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed loss over completion tokens and the statistics to accumulate (``weight`` = completion
    tokens, or completions with ``rl.loss_norm: sequence``; ``sums``: loss and the per-token
    statistics of :func:`policy_terms`; ``maxima`` / ``minima``: the ratio's extremes)."""
    ce, _, routing = token_nll(
        model,
        params,
        balancing,
        batch,
        cfg.train.loss_chunk,
        cfg.rl.replay_routes,
        sampling_distribution(cfg),
    )
    per_token, weights, per_token_stats, extremes = policy_terms(-ce, batch, cfg.rl)
    sums = {"loss": jnp.sum(per_token * weights)}
    sums |= {name: jnp.sum(value * weights) for name, value in per_token_stats.items()}
    stats = {
        "weight": weights.sum(),
        "tokens": batch["loss_mask"].astype(jnp.float32).sum(),
        "sums": sums,
        "maxima": {"max_ratio": extremes["max_ratio"]},
        "minima": {"min_ratio": extremes["min_ratio"]},
    }
    return sums["loss"], {**stats, **routing}
