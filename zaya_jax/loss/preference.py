"""Preference objectives on packed pairs: DPO (Rafailov et al. 2023), IPO (Azar et al. 2023) and
SimPO (Meng et al. 2024), the formulas of ``preference`` in :mod:`zaya_jax.config` (TRL's
``sigmoid``, ``ipo`` with summed log-probabilities as in the paper, and ``simpo`` losses).

Rows hold whole pairs (:mod:`zaya_jax.data.packing`): segment ``2k + 1`` of a row is the chosen
sequence of its k-th pair and segment ``2k + 2`` the rejected one, ``loss_mask`` marks each
completion's tokens, and ``reference_logps`` holds each sequence's reference log-probability on its
segment's first position (0 elsewhere), so a segment sum gives it back.

A sequence's log-probability is the sum over its completion tokens of the model's token
log-probabilities, from the same chunked cross-entropy as next-token training.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zaya_jax.config import Config
from zaya_jax.loss.forward import Batch, segment_sums, token_nll
from zaya_jax.model import Zaya


def sequence_logps(
    model: Zaya, params: dict[str, Any], balancing: dict[str, Any], batch: Batch, loss_chunk: int = 0
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(log-probabilities, completion tokens), both (batch, seq + 2) per segment (column s =
    segment s, see :func:`~zaya_jax.loss.forward.segment_sums`), and the routing statistics."""
    ce, _, routing = token_nll(model, params, balancing, batch, loss_chunk)
    mask = batch["loss_mask"].astype(jnp.float32)
    segments = batch["segment_ids"]
    return segment_sums(-ce * mask, segments), segment_sums(mask, segments), routing


def _pairs(per_segment: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) columns of per-segment values: segments 1, 3, 5 ... and 2, 4, 6 ..."""
    pairs = (per_segment.shape[1] - 1) // 2
    return per_segment[:, 1 : 2 * pairs : 2], per_segment[:, 2 : 2 * pairs + 1 : 2]


def preference_loss_and_stats(
    model: Zaya, params: dict[str, Any], balancing: dict[str, Any], batch: Batch, cfg: Config, variant: str
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed ``variant`` loss (dpo, ipo or simpo) over the batch's pairs and the statistics to
    accumulate (``weight`` = pairs; ``sums``: loss, chosen/rejected log-probabilities and rewards,
    reward margin, pair accuracy)."""
    beta = cfg.preference.beta
    logps, counts, routing = sequence_logps(model, params, balancing, batch, cfg.train.loss_chunk)
    chosen, rejected = _pairs(logps)
    chosen_n, rejected_n = _pairs(counts)
    valid = ((chosen_n > 0) & (rejected_n > 0)).astype(jnp.float32)
    if variant == "simpo":  # no reference: length-normalised log-probabilities
        chosen_reward = beta * chosen / jnp.maximum(chosen_n, 1.0)
        rejected_reward = beta * rejected / jnp.maximum(rejected_n, 1.0)
        losses = -jax.nn.log_sigmoid(chosen_reward - rejected_reward - cfg.preference.simpo_gamma)
    else:
        ref_chosen, ref_rejected = _pairs(segment_sums(batch["reference_logps"], batch["segment_ids"]))
        chosen_reward, rejected_reward = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
        h = (chosen - ref_chosen) - (rejected - ref_rejected)
        ipo = jnp.square(h - 1.0 / (2.0 * beta))
        losses = ipo if variant == "ipo" else -jax.nn.log_sigmoid(beta * h)
    pairs = valid.sum()

    def total(x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(valid > 0, x, 0.0))

    sums = {
        "loss": total(losses),
        "chosen_logp": total(chosen),
        "rejected_logp": total(rejected),
        "chosen_reward": total(chosen_reward),
        "rejected_reward": total(rejected_reward),
        "reward_margin": total(chosen_reward - rejected_reward),
        "pair_accuracy": total((chosen_reward > rejected_reward).astype(jnp.float32)),
    }
    tokens = (chosen_n + rejected_n).sum()
    return sums["loss"], {"weight": pairs, "tokens": tokens, "sums": sums, **routing}
