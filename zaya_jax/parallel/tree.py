"""Tree attention for decoding (Shyam et al., arXiv 2408.04093): the KV cache is split along the
sequence over a mesh axis; each device attends over its slice and returns its partial numerator,
denominator and running max, which one max all-reduce and sum all-reduces combine (the collective
library runs them as log-depth trees) instead of passing K/V around a ring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

if TYPE_CHECKING:
    from zaya_jax.model.mesh_hooks import AttentionKernel


def _local_partials(q, k, v, mask, axis: str):
    """One device's slice of the keys. Shapes as in ``zaya_jax.ops.attention.dot_product_attention``;
    a row with no visible key anywhere gets zeros, as there."""
    batch, seq, nq, d = q.shape
    nk = k.shape[2]
    groups = nq // nk
    qg = q.reshape(batch, seq, nk, groups, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * (d**-0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    local_max = jnp.max(scores, axis=-1, keepdims=True)
    global_max = jax.lax.pmax(local_max, axis)
    weights = jnp.where(mask[:, None, None], jnp.exp(scores - global_max), 0.0)
    denominator = jax.lax.psum(jnp.sum(weights, axis=-1, keepdims=True), axis)
    numerator = jax.lax.psum(jnp.einsum("bkgts,bskd->bkgtd", weights, v.astype(jnp.float32)), axis)
    out = (numerator / jnp.where(denominator > 0, denominator, 1.0)).astype(v.dtype)  # (b, nk, g, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, nq * d)


def tree_attention(mesh: Mesh, axis: str = "context") -> AttentionKernel:
    """An ``attention(q, k, v, mask) -> (batch, seq, nq*d)`` for :class:`zaya_jax.model.Zaya` whose
    keys/values (batch, S, nk, d) are split along S over ``axis``; queries are replicated and
    ``mask`` (an :class:`~zaya_jax.ops.attention.AttentionMask` over the S cache slots) is
    materialised as (batch, seq, S) and split the same way (decoding: seq is the few new tokens).
    Equal to single-device attention (the softmax is exact, not approximated)."""
    keys = PartitionSpec(None, axis, None, None)
    fn = jax.shard_map(
        lambda q, k, v, mask: _local_partials(q, k, v, mask, axis),
        mesh=mesh,
        in_specs=(PartitionSpec(), keys, keys, PartitionSpec(None, None, axis)),
        out_specs=PartitionSpec(),
    )
    return lambda q, k, v, mask: fn(q, k, v, mask.dense())
