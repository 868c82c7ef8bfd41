"""The pretraining and SFT objective: next-token cross-entropy (plus the optional z-loss) summed over
a batch's trained targets (``loss_mask``: every real token of text, the assistant turns of a chat).
Training and evaluation both call :func:`loss_and_stats`, so the held-out number is the training
number without the z-loss.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zaya_jax.loss.forward import Batch, token_nll
from zaya_jax.model import Zaya


def loss_and_stats(
    model: Zaya,
    params: dict[str, Any],
    balancing: dict[str, Any],
    batch: Batch,
    z_loss: float,
    loss_chunk: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed (not averaged) loss over the batch's trained targets, and the statistics to accumulate
    (the contract of :mod:`zaya_jax.loss.contract`: ``weight`` = trained tokens, ``sums`` =
    ``loss`` (cross-entropy) and ``log_z_squared``, and the routing statistics)."""
    ce, log_z, routing = token_nll(model, params, balancing, batch, loss_chunk)
    mask = batch["loss_mask"].astype(jnp.float32)
    ce_sum = jnp.sum(ce * mask)
    z_sum = jnp.sum(jnp.square(log_z) * mask)
    tokens = mask.sum()
    stats = {"weight": tokens, "tokens": tokens, "sums": {"loss": ce_sum, "log_z_squared": z_sum}, **routing}
    return ce_sum + z_loss * z_sum, stats
