"""Ring attention over a sequence split along the ``context`` mesh axis (Liu et al.): each device
keeps its query block and passes its key/value block (with the keys' segment ids, padding mask and
global positions) around the ring with ``ppermute``, merging every block into an online softmax.

Each hop is the blocked (flash-style) kernel, :func:`zaya_jax.ops.attention.blocked_attention`,
with causal, packed-document (segment ids), padding and sliding-window masks from global token
indices; hops are merged by their log-sum-exps, so the result equals attention over the whole
sequence, and the backward pass recomputes each hop's scores. This is the attention core of context
parallelism; the CCA convolution and delayed-value halos are separate.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from zaya_jax.ops.attention import AttentionMask, blocked_attention


def _merge(acc: tuple[jax.Array, jax.Array], part: tuple[jax.Array, jax.Array]):
    """Two attention results over disjoint key sets -> the result over their union. Each is
    (out (b, s, nq, d) float32, lse (b, s, nq)); a row with no visible key has lse -inf."""
    (out_a, lse_a), (out_b, lse_b) = acc, part
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_a, w_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = w_a + w_b
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = (w_a[..., None] * out_a + w_b[..., None] * out_b) / safe[..., None]
    return out, jnp.where(seen, top + jnp.log(safe), -jnp.inf)


def _ring_local(q, k, v, q_seg, k_seg, k_real, window, *, axis: str, size: int, block: int):
    """One device's queries against every device's keys, one hop of the ring at a time; each hop
    is :func:`~zaya_jax.ops.attention.blocked_attention` with the hop's global slots, and hops
    whose keys all come after the queries (or lie beyond the window) are not computed."""
    batch, seq, nq, d = q.shape
    me = jax.lax.axis_index(axis)
    local = jnp.arange(seq, dtype=jnp.int32)
    q_slots = me * seq + local
    perm = [(i, (i + 1) % size) for i in range(size)]
    empty = jnp.zeros_like(q, jnp.float32), jnp.full_like(q[..., 0], -jnp.inf, jnp.float32)
    acc = None
    for step in range(size):
        source = (me - step) % size  # whose key block this device holds now
        mask = AttentionMask(q_slots, source * seq + local, q_seg, k_seg, k_real, window, aligned=step == 0)

        def attend(k, v, mask=mask):
            return blocked_attention(q, k, v, mask, block=block, out_dtype=jnp.float32)

        if step == 0:  # this device's own keys: the diagonal
            part = attend(k, v)
        else:
            visible = source < me
            if window is not None:  # nearest pair of the hop: (me - source) * seq - (seq - 1) slots
                visible = visible & ((window <= 0) | ((me - source) * seq - (seq - 1) < window))
            part = jax.lax.cond(visible, attend, lambda k, v: empty, k, v)
        acc = part if acc is None else _merge(acc, part)
        if step + 1 < size:
            k, v, k_seg, k_real = (jax.lax.ppermute(x, axis, perm) for x in (k, v, k_seg, k_real))
    return acc[0].astype(v.dtype).reshape(batch, seq, nq * d)


def ring_attention(mesh: Mesh, axis: str = "context", block: int = 128) -> Any:
    """``attend(q, k, v, segment_ids, token_mask, window) -> (batch, seq, nq*d)`` with every
    sequence axis split over ``axis``. q: (batch, seq, nq, d); k, v: (batch, seq, nk, d);
    segment_ids, token_mask: (batch, seq); window: int32 scalar (<= 0: no sliding window) or None.
    ``block``: the blocked kernel's block length within each hop."""
    return _ring_attention_rows(mesh, None, axis, block)


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

    def __init__(self, mesh: Mesh, rows: tuple[str, ...] | None, axis: str = "context", block: int = 128):
        self.mesh, self.axis, self.size = mesh, axis, mesh.shape[axis]
        self.rows = rows
        self._attend = _ring_attention_rows(mesh, rows, axis, block)

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


def _ring_attention_rows(mesh: Mesh, rows: tuple[str, ...] | None, axis: str, block: int) -> Any:
    size = mesh.shape[axis]
    seq4 = PartitionSpec(rows, axis, None, None)
    seq2 = PartitionSpec(rows, axis)

    def attend(q, k, v, segment_ids, token_mask, window):
        def local(q, k, v, seg, real, *window):
            window = window[0] if window else None
            return _ring_local(
                q, k, v, seg, seg, real.astype(bool), window, axis=axis, size=size, block=block
            )

        windows = () if window is None else (window,)
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(seq4, seq4, seq4, seq2, seq2, *(PartitionSpec() for _ in windows)),
            out_specs=PartitionSpec(rows, axis, None),
        )
        return fn(q, k, v, segment_ids, token_mask, *windows)

    return attend
