"""Ring attention over a sequence split along the ``context`` mesh axis (Liu et al.): each device
keeps its query block and passes its key/value block (with the keys' segment ids, padding mask and
global positions) around the ring with ``ppermute``, merging every block into an online softmax.

Each hop is the blocked (flash-style) kernel, :func:`zaya_jax.ops.attention.blocked_attention`,
with causal, packed-document (segment ids), padding and sliding-window masks from global token
indices; hops are merged by their log-sum-exps, so the result equals attention over the whole
sequence, and the backward pass recomputes each hop's scores. This is the attention core of context
parallelism; the CCA convolution and delayed-value halos are separate.

Two layouts of the sequence over the n devices (:class:`ContextParallel`): contiguous shards, and
zig-zag (2n chunks, device i holding chunks i and 2n-1-i), which gives every device the same
causal work (Megatron's and torchtitan's load-balanced context parallelism; MaxText's
``dual_chunk_swap``). With zig-zag, each CCA convolution needs a halo per chunk: from the previous
device for the first chunk and from the next device for the second.
"""

from __future__ import annotations

from collections.abc import Callable

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


def _zigzag_ring_local(q, k, v, q_seg, k_seg, k_real, window, *, axis: str, size: int, block: int):
    """:func:`_ring_local` for the zig-zag layout: this device holds chunks ``me`` (first half)
    and ``2n-1-me`` (second half) of ``2n``. Its own keys: the two causal diagonals and the second
    half against the first; a hop from an earlier device: every query against that device's first
    chunk; from a later one: the second half's queries against both of its chunks. Every device
    computes the same number of scores at every hop (half of a full block), so the causal work is
    balanced."""
    batch, seq, nq, d = q.shape
    c = seq // 2
    me = jax.lax.axis_index(axis)
    local = jnp.arange(c, dtype=jnp.int32)

    def slots(device):
        return jnp.concatenate([device * c + local, (2 * size - 1 - device) * c + local])

    q_slots = slots(me)
    perm = [(i, (i + 1) % size) for i in range(size)]
    first, second = slice(None, c), slice(c, None)
    no_rows = jnp.zeros((batch, c, nq, d), jnp.float32), jnp.full((batch, c, nq), -jnp.inf, jnp.float32)

    def attend(k, v, k_slots, k_seg, k_real, rows, aligned=False):
        mask = AttentionMask(q_slots[rows], k_slots, q_seg[:, rows], k_seg, k_real, window, aligned=aligned)
        return blocked_attention(q[:, rows], k, v, mask, block=block, out_dtype=jnp.float32)

    # this device's own keys
    a = attend(k[:, first], v[:, first], q_slots[first], k_seg[:, first], k_real[:, first], first, True)
    b = _merge(
        attend(
            k[:, second], v[:, second], q_slots[second], k_seg[:, second], k_real[:, second], second, True
        ),
        attend(k[:, first], v[:, first], q_slots[first], k_seg[:, first], k_real[:, first], second),
    )
    acc = tuple(jnp.concatenate([x, y], axis=1) for x, y in zip(a, b, strict=True))
    for step in range(1, size):
        k, v, k_seg, k_real = (jax.lax.ppermute(x, axis, perm) for x in (k, v, k_seg, k_real))
        source = (me - step) % size
        k_slots = slots(source)

        # Both branches are two (c x c) kernel calls, so every device's hop costs the same.
        def earlier(k, v, k_seg, k_real, k_slots=k_slots):  # every query, the source's first chunk
            keys = (k[:, first], v[:, first], k_slots[first], k_seg[:, first], k_real[:, first])
            parts = attend(*keys, first), attend(*keys, second)
            return tuple(jnp.concatenate(pair, axis=1) for pair in zip(*parts, strict=True))

        def later(k, v, k_seg, k_real, k_slots=k_slots):  # the second half's queries, both chunks
            out = _merge(
                attend(k[:, first], v[:, first], k_slots[first], k_seg[:, first], k_real[:, first], second),
                attend(
                    k[:, second], v[:, second], k_slots[second], k_seg[:, second], k_real[:, second], second
                ),
            )
            return tuple(jnp.concatenate(pair, axis=1) for pair in zip(no_rows, out, strict=True))

        acc = _merge(acc, jax.lax.cond(source < me, earlier, later, k, v, k_seg, k_real))
    return acc[0].astype(v.dtype).reshape(batch, seq, nq * d)


def ring_attention(
    mesh: Mesh, axis: str = "context", block: int = 128, layout: str = "contiguous"
) -> Callable[..., jax.Array]:
    """``attend(q, k, v, segment_ids, token_mask, window) -> (batch, seq, nq*d)`` with every
    sequence axis split over ``axis``. q: (batch, seq, nq, d); k, v: (batch, seq, nk, d);
    segment_ids, token_mask: (batch, seq); window: int32 scalar (<= 0: no sliding window) or None.
    ``block``: the blocked kernel's block length within each hop. ``layout="zigzag"``: the inputs
    are reordered into the zig-zag layout and the output back (:class:`ContextParallel`)."""
    hook = ContextParallel(mesh, None, axis, block, layout)

    def attend(q, k, v, segment_ids, token_mask, window):
        q, k, v, segment_ids, token_mask = map(hook.reorder, (q, k, v, segment_ids, token_mask))
        return hook.restore(hook.attention(q, k, v, segment_ids, token_mask, window))

    return attend


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


def _halos(x: jax.Array, n: int, axis: str, size: int) -> tuple[jax.Array, jax.Array]:
    """Zig-zag layout: the ``n`` positions before each of this device's two chunks, (before its
    first chunk: the previous device's first-chunk tail, zeros on device 0; before its second: the
    next device's second-chunk tail, or on the last device its own first-chunk tail)."""
    c = x.shape[1] // 2
    first_tail, second_tail = x[:, c - n : c], x[:, x.shape[1] - n :]
    before_first = jax.lax.ppermute(first_tail, axis, [(i, i + 1) for i in range(size - 1)])
    from_next = jax.lax.ppermute(second_tail, axis, [(i + 1, i) for i in range(size - 1)])
    last = jax.lax.axis_index(axis) == size - 1
    return before_first, jnp.where(last, first_tail, from_next)


def _zigzag_temporal_local(
    z, vd, vd_at_start, segments, dw_kernel, dw_bias, g_kernel, g_bias, *, axis, size, context
):
    """:func:`_temporal_local` for the zig-zag layout: each of the two chunks gets its own halo."""
    from zaya_jax.model.cca import same_document, shift_right, two_stage_conv

    c = z.shape[1] // 2
    halo = max(context, 1)
    first = jax.lax.axis_index(axis) == 0
    seg_a, seg_b = _halos(segments, halo, axis, size)
    seg_halos = (jnp.where(first, -1, seg_a), seg_b)  # -1: no document before the sequence
    z_halos = _halos(z, context, axis, size) if context else (None, None)
    vd_halos = _halos(vd, 1, axis, size)
    convs, shifted = [], []
    for part, seg_halo, z_halo, vd_halo in zip(
        (slice(None, c), slice(c, None)), seg_halos, z_halos, vd_halos, strict=True
    ):
        seg_full = jnp.concatenate([seg_halo, segments[:, part]], axis=1)
        if context:
            z_full = jnp.concatenate([z_halo, z[:, part]], axis=1)
            conv = two_stage_conv(z_full, dw_kernel, dw_bias, g_kernel, g_bias, seg_full[:, halo - context :])
            convs.append(conv[:, context:])
        else:
            convs.append(two_stage_conv(z[:, part], dw_kernel, dw_bias, g_kernel, g_bias, segments[:, part]))
        vd_full = jnp.concatenate([vd_halo, vd[:, part]], axis=1)
        seg_v = seg_full[:, halo - 1 :]
        keep = same_document(seg_v, seg_v.shape[1], 1)[..., None]
        shifted.append(jnp.where(keep, shift_right(vd_full, 1), vd_at_start)[:, 1:])
    return jnp.concatenate(convs, axis=1), jnp.concatenate(shifted, axis=1)


def _chunk_owner(chunk: int, size: int) -> int:
    """The device holding chunk ``chunk`` of ``2 * size`` in the zig-zag layout."""
    return chunk if chunk < size else 2 * size - 1 - chunk


def _zigzag_local(x: jax.Array, *, axis: str, size: int, inverse: bool) -> jax.Array:
    """Contiguous -> zig-zag (or back, ``inverse``) along axis 1: device i holds chunks 2i, 2i+1
    contiguously and chunks i, 2n-1-i zig-zagged. Two ``ppermute``s of half the local block: the
    even chunks go to distinct devices, and so do the odd ones."""
    c = x.shape[1] // 2
    even_perm = [(i, _chunk_owner(2 * i, size)) for i in range(size)]
    odd_perm = [(i, _chunk_owner(2 * i + 1, size)) for i in range(size)]
    me_even = jax.lax.axis_index(axis) % 2 == 0  # zig-zag: chunk me is even on even devices
    if not inverse:
        even = jax.lax.ppermute(x[:, :c], axis, even_perm)
        odd = jax.lax.ppermute(x[:, c:], axis, odd_perm)
        return jnp.where(me_even, jnp.concatenate([even, odd], 1), jnp.concatenate([odd, even], 1))
    mine_first, mine_second = x[:, :c], x[:, c:]
    even = jnp.where(me_even, mine_first, mine_second)
    odd = jnp.where(me_even, mine_second, mine_first)
    back_even = jax.lax.ppermute(even, axis, [(j, i) for i, j in even_perm])
    back_odd = jax.lax.ppermute(odd, axis, [(j, i) for i, j in odd_perm])
    return jnp.concatenate([back_even, back_odd], 1)


class ContextParallel:
    """The ``context`` hook of :class:`zaya_jax.model.Zaya` for sequences split over the context
    axis: the CCA q/k convolution and the delayed value get their left halos (P raw columns and
    one token) from the device holding the positions before them, attention runs as a ring.

    ``layout``: ``contiguous`` (device i holds the i-th n-th of the sequence; under the causal mask
    the last device attends to every key, the first to its own only) or ``zigzag`` (the sequence in
    2n chunks, device i holding chunks i and 2n-1-i: every device computes the same number of
    scores). The model reorders its token inputs into the layout and its output back
    (:meth:`reorder`, :meth:`restore`)."""

    def __init__(
        self,
        mesh: Mesh,
        rows: tuple[str, ...] | None,
        axis: str = "context",
        block: int = 128,
        layout: str = "contiguous",
    ):
        if layout not in ("contiguous", "zigzag"):
            raise ValueError(f"context layout {layout!r} is unknown; use contiguous or zigzag")
        self.mesh, self.axis, self.size = mesh, axis, mesh.shape[axis]
        self.rows, self.layout = rows, layout
        self._attend = _ring_attention_rows(mesh, rows, axis, block, zigzag=layout == "zigzag")

    def reorder(self, x: jax.Array) -> jax.Array:
        """(batch, seq, ...) in sequence order -> in this layout's order along the context axis."""
        return self._move(x, inverse=False)

    def restore(self, x: jax.Array) -> jax.Array:
        """The inverse of :meth:`reorder`."""
        return self._move(x, inverse=True)

    def _move(self, x: jax.Array, inverse: bool) -> jax.Array:
        if self.layout == "contiguous":
            return x
        spec = PartitionSpec(self.rows, self.axis, *([None] * (x.ndim - 2)))
        fn = jax.shard_map(
            lambda x: _zigzag_local(x, axis=self.axis, size=self.size, inverse=inverse),
            mesh=self.mesh,
            in_specs=(spec,),
            out_specs=spec,
        )
        return fn(x)

    def temporal(self, z, vd, vd_at_start, segments, dw_kernel, dw_bias, g_kernel, g_bias, context: int):
        seq3 = PartitionSpec(self.rows, self.axis, None)
        seq2 = PartitionSpec(self.rows, self.axis)
        rep = PartitionSpec()
        local = _zigzag_temporal_local if self.layout == "zigzag" else _temporal_local
        fn = jax.shard_map(
            lambda *a: local(*a, axis=self.axis, size=self.size, context=context),
            mesh=self.mesh,
            in_specs=(seq3, seq3, rep, seq2, rep, rep, rep, rep),
            out_specs=(seq3, seq3),
        )
        return fn(z, vd, vd_at_start, segments, dw_kernel, dw_bias, g_kernel, g_bias)

    def attention(self, q, k, v, segments, token_mask, window):
        return self._attend(q, k, v, segments, token_mask, window)


def _ring_attention_rows(
    mesh: Mesh, rows: tuple[str, ...] | None, axis: str, block: int, zigzag: bool = False
) -> Callable[..., jax.Array]:
    size = mesh.shape[axis]
    ring = _zigzag_ring_local if zigzag else _ring_local
    seq4 = PartitionSpec(rows, axis, None, None)
    seq2 = PartitionSpec(rows, axis)

    def attend(q, k, v, segment_ids, token_mask, window):
        def local(q, k, v, seg, real, *window):
            window = window[0] if window else None
            return ring(q, k, v, seg, seg, real.astype(bool), window, axis=axis, size=size, block=block)

        windows = () if window is None else (window,)
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(seq4, seq4, seq4, seq2, seq2, *(PartitionSpec() for _ in windows)),
            out_specs=PartitionSpec(rows, axis, None),
        )
        return fn(q, k, v, segment_ids, token_mask, *windows)

    return attend
