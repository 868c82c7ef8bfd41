"""The training objective: next-token cross-entropy (plus the optional z-loss) summed over a batch's
real targets, with the statistics that training accumulates across micro-batches.

A batch is a dict of (batch, seq) arrays (:data:`zaya_jax.data.BATCH_KEYS`): ``inputs``,
``targets``, ``segment_ids`` (0 = padding), ``positions`` and ``loss_mask``. Training and evaluation
both call :func:`loss_and_stats`, so the held-out number is the training number without the z-loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zaya_jax.config import Config
from zaya_jax.model import BALANCING, Zaya
from zaya_jax.model.hooks import SINGLE_DEVICE, ModelHooks
from zaya_jax.model.transformer import lm_head_weights
from zaya_jax.ops.cross_entropy import chunked_cross_entropy

Batch = dict[str, jax.Array]


def token_losses(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy and log-partition, both (batch, seq) float32; logits upcast first."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit, log_z


def _shard_vocab(x: jax.Array, axis: int) -> jax.Array:
    """The LM head inside the loss split along its vocabulary (logical axis ``vocab_parallel``),
    not along the residual width as the parameter is stored; a no-op outside the step's rules."""
    names = [None] * x.ndim
    names[axis] = "vocab_parallel"
    return nn.with_logical_constraint(x, tuple(names))


def loss_and_stats(
    model: Zaya, params: Any, balancing: Any, batch: Batch, z_loss: float, loss_chunk: int = 0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed (not averaged) loss over the batch's real targets, and the statistics to accumulate.

    The LM head is applied by :func:`~zaya_jax.ops.cross_entropy.chunked_cross_entropy`,
    ``loss_chunk`` sequence positions at a time (0: automatic), so the full float32 logits never
    exist; the result equals :func:`token_losses` of the model's logits."""
    hidden, aux = model.apply(
        {"params": params, BALANCING: balancing},
        batch["inputs"],
        token_mask=batch["segment_ids"] > 0,
        segment_ids=batch["segment_ids"],
        positions=batch["positions"],
        return_hidden=True,
    )
    weight, bias, vocab_axis = lm_head_weights(model.cfg, params)
    mask = batch["loss_mask"].astype(jnp.float32)
    ce, log_z = chunked_cross_entropy(
        hidden,
        weight,
        batch["targets"],
        bias=bias,
        vocab_axis=vocab_axis,
        chunk=loss_chunk,
        shard_vocab=_shard_vocab,
    )
    ce_sum = jnp.sum(ce * mask)
    z_sum = jnp.sum(jnp.square(log_z) * mask)
    stats = {
        "ce_sum": ce_sum,
        "z_sum": z_sum,
        "tokens": mask.sum(),
        "routed": (batch["segment_ids"] > 0).sum().astype(jnp.float32),
        "load": aux["load"],
        "dropped": aux["dropped"],
        "prob_dev_sum": aux["prob_dev_sum"],
        "prob_dev_sq_sum": aux["prob_dev_sq_sum"],
    }
    return ce_sum + z_loss * z_sum, stats


def under_axis_rules(fn: Callable, axis_rules: tuple[Any, Any] | None) -> Callable:
    """``fn`` traced under a mesh and its logical-axis rules (``Layout.step_hooks``), so that the
    model's and the loss's logical sharding constraints apply; without them they are no-ops."""
    if axis_rules is None:
        return fn
    mesh, rules = axis_rules

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with nn.logical_axis_rules(rules), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def make_eval_step(
    cfg: Config,
    hooks: ModelHooks = SINGLE_DEVICE,
    axis_rules: tuple[Any, Any] | None = None,
) -> Callable[[Any, Any, Batch], tuple[jax.Array, jax.Array]]:
    """(params, balancing, batch) -> (summed cross-entropy, number of target tokens); arguments
    as :func:`zaya_jax.train.step.make_train_step`'s."""
    model = Zaya(cfg.model, hooks)

    def evaluate(params: Any, balancing: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        _, stats = loss_and_stats(model, params, balancing, batch, 0.0, cfg.train.loss_chunk)
        return stats["ce_sum"], stats["tokens"]

    return under_axis_rules(evaluate, axis_rules)
