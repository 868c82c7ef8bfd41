"""The bottom of the attention package: which keys a query may see, and what every kernel shares.

Which keys a query may see is described by an :class:`AttentionMask` of positions and ids, never by
a materialised (seq_q, seq_k) array: key slot <= query slot (causal), same document (segment ids),
key not padding, and within a sliding window of slots. Each block of the mask is computed from
these when it is needed (:func:`visible_keys`; :meth:`AttentionMask.dense` for the whole of it).

Also here: the fused kernels' argument checks (:func:`check_fused_inputs`), the mask as the per-row
integer vectors the fused kernels read (:func:`mask_rows`, with the bounds ``FAR`` and
``NO_DOCUMENT``), and the one padding helper the kernels share (:func:`pad_axis`). This module
imports no other module of the package.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class AttentionMask:
    """Which keys each query may attend to, described by positions and ids.

    q_slots: (seq_q,) and k_slots: (seq_k,) int32 sequence (or cache) indices; a key is visible
    when its slot <= the query's slot. q_slots may also be (batch, seq_q), one row of slots per
    sequence (a slot cache whose rows are written at their own offsets, :mod:`zaya_jax.engine`):
    only the dense definition reads such a mask (:attr:`per_row`), whose k_slots may then be
    (batch, seq_k) too (a sliding layer's window cache: its ring holds other positions in each row). q_segments/k_segments:
    (batch, seq_q/seq_k) document ids, a key is visible only within the query's document (both or
    neither). k_valid: (batch, seq_k) bool,
    False for padding keys. window: int32 scalar, a key is visible when fewer than ``window`` slots
    before the query (<= 0: unlimited); None when no layer of the model has a window.
    ``aligned`` (static): q_slots and k_slots are the same consecutive slots (a sequence attending
    to itself), which lets the blocked kernel skip the blocks above the diagonal.
    """

    q_slots: jax.Array
    k_slots: jax.Array
    q_segments: jax.Array | None = None
    k_segments: jax.Array | None = None
    k_valid: jax.Array | None = None
    window: jax.Array | None = None
    aligned: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def per_row(self) -> bool:
        """Each row has its own query slots ((batch, seq_q) ``q_slots``)."""
        return self.q_slots.ndim == 2

    def dense(self) -> jax.Array:
        """(batch or 1, seq_q, seq_k) bool: the whole mask (for the dense reference and decoding)."""
        if self.per_row:  # one row of query slots per sequence: the causal and window terms per row
            k_slots = self.k_slots if self.k_slots.ndim == 2 else self.k_slots[None]
            ok = visible_keys(self.q_slots, k_slots, None, None, None, self.window)[0]
            if self.q_segments is not None:
                ok = ok & (self.q_segments[..., :, None] == self.k_segments[..., None, :])
            return ok if self.k_valid is None else ok & self.k_valid[..., None, :]
        return visible_keys(
            self.q_slots, self.k_slots, self.q_segments, self.k_segments, self.k_valid, self.window
        )


def self_attention_mask(
    seq: int, segment_ids: jax.Array | None = None, token_mask: jax.Array | None = None
) -> AttentionMask:
    """The mask of a (batch, seq) sequence attending to itself: causal, within documents, no padding keys."""
    slots = jnp.arange(seq, dtype=jnp.int32)
    return AttentionMask(
        q_slots=slots,
        k_slots=slots,
        q_segments=segment_ids,
        k_segments=segment_ids,
        k_valid=None if token_mask is None else token_mask.astype(bool),
        aligned=True,
    )


def visible_keys(q_slots, k_slots, q_seg, k_seg, k_valid, window) -> jax.Array:
    """(batch or 1, ..., tq, tk) bool from q_slots (..., tq), k_slots (..., tk) and per-row
    q_seg (batch, ..., tq), k_seg/k_valid (batch, ..., tk)."""
    q_s, k_s = q_slots[..., :, None], k_slots[..., None, :]
    ok = k_s <= q_s
    if window is not None:
        ok = ok & ((window <= 0) | (q_s - k_s < window))
    ok = ok[None]
    if q_seg is not None:
        ok = ok & (q_seg[..., :, None] == k_seg[..., None, :])
    if k_valid is not None:
        ok = ok & k_valid[..., None, :]
    return ok


FAR = 2**30  # a slot bound no real slot reaches
NO_DOCUMENT = -(2**30)  # the segment of a padding key


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """``x`` padded at the end of ``axis`` to ``size`` entries with ``value``."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def check_fused_inputs(q: jax.Array, k: jax.Array, mask: AttentionMask) -> None:
    """The fused kernels' argument checks: document ids on both sides or neither, and query heads a
    multiple of the key/value heads."""
    if (mask.q_segments is None) != (mask.k_segments is None):
        raise ValueError("AttentionMask needs both q_segments and k_segments, or neither")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads")


def mask_rows(mask, batch: int, seq_q: int, seq_k: int, padded_q: int, padded_k: int):
    """The mask as per-row int32 vectors, padded to ``padded_q``/``padded_k`` rows, for the fused
    kernels (Pallas on GPUs, the CPU custom call): (q_slot (sq), q_low (sq), q_seg (batch, sq),
    k_slot (sk), k_high (sk), k_seg (batch, sk)). Key j is visible to query i when
    ``q_low[i] <= k_slot[j] <= q_slot[i]`` and ``q_seg[i] == k_seg[j]``; ``q_low`` is the window's
    first slot (``-FAR`` without one), ``k_high`` a key's last query slot; a padding key's segment
    is ``NO_DOCUMENT``."""
    q_slot = jnp.broadcast_to(mask.q_slots.astype(jnp.int32), (seq_q,))
    k_slot = jnp.broadcast_to(mask.k_slots.astype(jnp.int32), (seq_k,))
    window = jnp.asarray(0 if mask.window is None else mask.window, jnp.int32)
    limited = window > 0
    q_low = jnp.where(limited, q_slot - window + 1, -FAR)
    k_high = jnp.where(limited, k_slot + window - 1, FAR)
    q_seg = (
        jnp.zeros((batch, seq_q), jnp.int32) if mask.q_segments is None else mask.q_segments.astype(jnp.int32)
    )
    k_seg = (
        jnp.zeros((batch, seq_k), jnp.int32) if mask.k_segments is None else mask.k_segments.astype(jnp.int32)
    )
    if mask.k_valid is not None:
        k_seg = jnp.where(mask.k_valid, k_seg, NO_DOCUMENT)
    return (
        pad_axis(q_slot, 0, padded_q, -1),  # padded queries see nothing
        pad_axis(q_low, 0, padded_q, FAR),
        pad_axis(q_seg, 1, padded_q, 0),
        pad_axis(k_slot, 0, padded_k, FAR),  # padded keys are seen by nothing
        pad_axis(k_high, 0, padded_k, -FAR),
        pad_axis(k_seg, 1, padded_k, NO_DOCUMENT),
    )
