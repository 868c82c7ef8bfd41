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
    return _ring_attention_rows(mesh, None, axis)


def _left_halo(x: jax.Array, n: int, axis: str, size: int) -> jax.Array:
    """The previous device's last ``n`` positions along axis 1 (zeros on the first device)."""
    perm = [(i, i + 1) for i in range(size - 1)]
    return jax.lax.ppermute(x[:, x.shape[1] - n :], axis, perm)


def _temporal_local(
    z, vd, vd_at_start, segments, dw_kernel, dw_bias, g_kernel, g_bias, *, axis, size, context
):
    """One device's CCA convolution and value shift with halos from its left neighbour."""
    from zaya_jax.model.cca import same_document, shift_right, two_stage_conv

    first = jax.lax.axis_index(axis) == 0
    halo = max(context, 1)
    seg_halo = jnp.where(first, -1, _left_halo(segments, halo, axis, size))  # -1: no document
    seg_full = jnp.concatenate([seg_halo, segments], axis=1)
    if context:
        z_full = jnp.concatenate([_left_halo(z, context, axis, size), z], axis=1)
        conv = two_stage_conv(z_full, dw_kernel, dw_bias, g_kernel, g_bias, seg_full[:, halo - context :])
        conv = conv[:, context:]
    else:
        conv = two_stage_conv(z, dw_kernel, dw_bias, g_kernel, g_bias, segments)
    vd_full = jnp.concatenate([_left_halo(vd, 1, axis, size), vd], axis=1)
    seg_v = seg_full[:, halo - 1 :]
    keep = same_document(seg_v, seg_v.shape[1], 1)[..., None]
    shifted = jnp.where(keep, shift_right(vd_full, 1), vd_at_start)[:, 1:]
    return conv, shifted


class ContextParallel:
    """The ``context`` hook of :class:`zaya_jax.model.Zaya` for sequences split over the context
    axis: the CCA q/k convolution and the delayed value get their left halos (P raw columns and
    one token) from the previous device, attention runs as :func:`ring_attention`."""

    def __init__(self, mesh: Mesh, rows: tuple[str, ...] | None, axis: str = "context"):
        self.mesh, self.axis, self.size = mesh, axis, mesh.shape[axis]
        self.rows = rows
        self._attend = _ring_attention_rows(mesh, rows, axis)

    def temporal(self, z, vd, vd_at_start, segments, dw_kernel, dw_bias, g_kernel, g_bias, context: int):
        seq3 = PartitionSpec(self.rows, self.axis, None)
        seq2 = PartitionSpec(self.rows, self.axis)
        rep = PartitionSpec()
        fn = jax.shard_map(
            lambda *a: _temporal_local(*a, axis=self.axis, size=self.size, context=context),
            mesh=self.mesh,
            in_specs=(seq3, seq3, rep, seq2, rep, rep, rep, rep),
            out_specs=(seq3, seq3),
        )
        return fn(z, vd, vd_at_start, segments, dw_kernel, dw_bias, g_kernel, g_bias)

    def attention(self, q, k, v, segments, token_mask, window):
        return self._attend(q, k, v, segments, token_mask, window)


def _ring_attention_rows(mesh: Mesh, rows: tuple[str, ...] | None, axis: str) -> Any:
    size = mesh.shape[axis]
    seq4 = PartitionSpec(rows, axis, None, None)
    seq2 = PartitionSpec(rows, axis)

    def attend(q, k, v, segment_ids, token_mask, window):
        fn = jax.shard_map(
            lambda q, k, v, seg, real, window: _ring_local(
                q, k, v, seg, seg, real.astype(bool), window, axis=axis, size=size
            ),
            mesh=mesh,
            in_specs=(seq4, seq4, seq4, seq2, seq2, PartitionSpec()),
            out_specs=PartitionSpec(rows, axis, None),
        )
        return fn(q, k, v, segment_ids, token_mask, window)

    return attend
