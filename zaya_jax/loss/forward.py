"""The model's forward pass as every objective reads it: the per-token negative log-likelihood of a
batch's targets and the log-partition (the LM head applied chunk by chunk, so the full float32
logits never exist), the routing statistics the balancing controller accumulates, and per-sequence
sums over packed segments.

A batch is a dict of (batch, seq) arrays (:mod:`zaya_jax.data.batch`): ``inputs``, ``targets``,
``segment_ids`` (0 = padding), ``positions``, ``loss_mask``, and what an objective adds (``routes``,
(batch, seq, layers), replays a sampler's routing: :class:`zaya_jax.model.Zaya`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zaya_jax.model import BALANCING, Zaya
from zaya_jax.model.transformer import lm_head_weights
from zaya_jax.ops.cross_entropy import MODEL_DISTRIBUTION, chunked_cross_entropy

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


def _vocab_tiling() -> bool:
    """Whether the loss's backward pass walks vocabulary tiles: on one device (or outside a step's
    mesh). On a mesh the rows are split and the vocabulary may be (each tile's hidden-state
    gradient would then be reduced over its devices); there the measured plans gained nothing from
    tiles (ZAYA1-8B at 32k with expert 8 x context 8: +0.88 GB; ZeRO-1 at 4k on 8: +0.07 GB)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


def token_nll(
    model: Zaya,
    params: dict[str, Any],
    balancing: dict[str, Any],
    batch: Batch,
    loss_chunk: int = 0,
    replay_routes: bool = True,
    distribution: tuple[float, int, float] = MODEL_DISTRIBUTION,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(cross-entropy, log-partition, routing statistics): the first two (batch, seq) float32 for
    every target (masked or not), equal to :func:`token_losses` of the model's logits; the LM head
    applied ``loss_chunk`` positions at a time (0: automatic). With ``batch["routes"]`` each layer
    selects the given classes (router replay), or with ``replay_routes=False`` only counts how
    often its own choice differs from them. ``distribution`` (temperature, top_k, top_p), with the
    batch's ``vocab_limit`` field where it has one: the cross-entropy under the distribution a
    sampler drew the targets from (:func:`zaya_jax.ops.cross_entropy.chunked_cross_entropy`)."""
    hidden, aux = model.apply(
        {"params": params, BALANCING: balancing},
        batch["inputs"],
        token_mask=batch["segment_ids"] > 0,
        segment_ids=batch["segment_ids"],
        positions=batch["positions"],
        routes=batch.get("routes"),
        replay_routes=replay_routes,
        return_hidden=True,
    )
    weight, bias, vocab_axis = lm_head_weights(model.cfg, params)
    ce, log_z = chunked_cross_entropy(
        hidden,
        weight,
        batch["targets"],
        bias=bias,
        vocab_axis=vocab_axis,
        chunk=loss_chunk,
        shard_vocab=_shard_vocab,
        distribution=distribution,
        vocab_limit=batch.get("vocab_limit"),
        vocab_tiling=_vocab_tiling(),
    )
    return ce, log_z, routing_stats(batch, aux)


def routing_stats(batch: Batch, aux: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """What the balancing controller and the routing metrics accumulate over micro-batches (with
    captured routes also ``routes_captured`` and ``route_flips``, summed over layers)."""
    stats = {
        "routed": (batch["segment_ids"] > 0).sum().astype(jnp.float32),
        "load": aux["load"],
        "dropped": aux["dropped"],
        "prob_dev_sum": aux["prob_dev_sum"],
        "prob_dev_sq_sum": aux["prob_dev_sq_sum"],
        "entropy_sum": aux["entropy_sum"],
    }
    for name in ("routes_captured", "route_flips"):
        if name in aux:
            stats[name] = aux[name].sum()
    return stats


def segment_sums(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """(batch, seq + 2) sums of (batch, seq) ``values`` over each row's segments: column ``s`` sums
    segment ``s`` (column 0 the padding); columns past a row's last segment are 0."""
    rows, seq = values.shape
    width = seq + 2
    ids = (jnp.arange(rows)[:, None] * width + segment_ids).reshape(-1)
    sums = jax.ops.segment_sum(values.reshape(-1), ids, num_segments=rows * width)
    return sums.reshape(rows, width)


def under_axis_rules(
    fn: Callable, axis_rules: tuple[jax.sharding.Mesh, Sequence[tuple[str, Any]]] | None
) -> Callable:
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
