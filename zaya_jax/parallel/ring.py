"""Ring attention over a sequence split along the ``context`` mesh axis (Liu et al.): each device
keeps its query block and passes its key/value block (with the keys' segment ids, padding mask and
global positions) around the ring with ``ppermute``, merging every block into an online softmax.

Causal, packed-document (segment ids), padding and sliding-window masks are applied per block from
global token indices, so the result equals :func:`zaya_jax.model.cca.dot_product_attention` on the
whole sequence. This is the attention core of context parallelism; the CCA convolution and
delayed-value halos are separate.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec


def _ring_local(q, k, v, q_seg, k_seg, k_real, window, *, axis: str, size: int):
    batch, seq, nq, d = q.shape
    nk = k.shape[2]
    groups = nq // nk
    me = jax.lax.axis_index(axis)
    q_slots = me * seq + jnp.arange(seq)
    qg = q.reshape(batch, seq, nk, groups, d).astype(jnp.float32) * (d**-0.5)
    low = jnp.finfo(jnp.float32).min
    m = jnp.full((batch, nk, groups, seq, 1), low, jnp.float32)
    l = jnp.zeros((batch, nk, groups, seq, 1), jnp.float32)  # noqa: E741
    o = jnp.zeros((batch, nk, groups, seq, d), jnp.float32)
    perm = [(i, (i + 1) % size) for i in range(size)]
    for step in range(size):
        source = (me - step) % size  # whose key block this device holds now
        k_slots = source * seq + jnp.arange(seq)
        allowed = (k_slots[None, :] <= q_slots[:, None]) & (
            (window <= 0) | (q_slots[:, None] - k_slots[None, :] < window)
        )
        allowed = allowed[None] & (q_seg[:, :, None] == k_seg[:, None, :]) & k_real[:, None, :]
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32))
        scores = jnp.where(allowed[:, None, None], scores, low)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
        weights = jnp.exp(scores - m_new)
        scale = jnp.exp(m - m_new)
        l = l * scale + jnp.sum(weights, axis=-1, keepdims=True)  # noqa: E741
        o = o * scale + jnp.einsum("bkgts,bskd->bkgtd", weights, v.astype(jnp.float32))
        m = m_new
        if step + 1 < size:
            k, v, k_seg, k_real = (jax.lax.ppermute(x, axis, perm) for x in (k, v, k_seg, k_real))
    out = (o / l).astype(v.dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, nq * d)


def ring_attention(mesh: Mesh, axis: str = "context") -> Any:
    """``attend(q, k, v, segment_ids, token_mask, window) -> (batch, seq, nq*d)`` with every
    sequence axis split over ``axis``. q: (batch, seq, nq, d); k, v: (batch, seq, nk, d);
    segment_ids, token_mask: (batch, seq); window: int32 scalar (<= 0: no sliding window)."""
    size = mesh.shape[axis]
    seq4 = PartitionSpec(None, axis, None, None)
    seq2 = PartitionSpec(None, axis)

    def attend(q, k, v, segment_ids, token_mask, window):
        fn = jax.shard_map(
            lambda q, k, v, seg, real, window: _ring_local(
                q, k, v, seg, seg, real.astype(bool), window, axis=axis, size=size
            ),
            mesh=mesh,
            in_specs=(seq4, seq4, seq4, seq2, seq2, PartitionSpec()),
            out_specs=PartitionSpec(None, axis, None),
        )
        return fn(q, k, v, segment_ids, token_mask, window)

    return attend
