"""The blocked kernel: flash-style attention (FlashAttention-2, Dao 2023) written in plain JAX, so
every platform runs it and XLA fuses it, never building a (seq, seq) array.

:func:`blocked_attention` keeps a running max, denominator and output per query row while it walks
over key blocks, and returns the output and the per-row log-sum-exp. Its ``custom_vjp`` saves only
q, k, v, the output and the log-sum-exp and recomputes each block's scores in the backward pass, so
memory grows linearly with the sequence in both directions. Two schedules:

* ``aligned`` masks (training and evaluation: queries and keys are the same slots): the key blocks
  are walked by block diagonal; diagonal t pairs query block i with key block i - t for every i at
  once (one batched matmul per diagonal), so blocks above the diagonal are never computed, and a
  diagonal entirely outside the sliding window is skipped (``lax.cond`` on the traced window).
* any other slots (prefill into a decode cache, a context-parallel ring hop): a ``lax.scan`` over key
  blocks against all queries, masks from the slots.

The log-sum-exp output has a cotangent of its own (``d lse / d s = softmax``), so partial results
of separate key sets can be merged outside the kernel and differentiated (ring attention). It is the
portable default, the reference of the fused kernels, and their stand-in where they cannot run.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from zaya_jax.ops.attention.masks import AttentionMask, pad_axis, visible_keys

# Layout: a sequence of n blocks of B slots. Query-like tensors are (b, nk, n, g, B, ...), key-like
# (b, nk, n, B, d), slots (n, B), per-row ids (b, n, B). A *pair group* is P key blocks, each with m
# query blocks it is compared against: queries (b, nk, P, m, g, Bq, d), keys (b, nk, P, Bk, d),
# visibility (b|1, P, m, Bq, Bk); every product is one batched matmul over (b, nk, P).


def _halves(x: jax.Array, axis: int, level: int) -> tuple[jax.Array, jax.Array]:
    """Split the block axis of ``x`` (n blocks) into 2^level rectangles of two halves of m blocks:
    returns (first halves, second halves), each with the block axis replaced by (2^level, m)."""
    n = x.shape[axis]
    r = 2**level
    x = x.reshape(*x.shape[:axis], r, 2, n // (2 * r), *x.shape[axis + 1 :])
    return jnp.take(x, 0, axis=axis + 1), jnp.take(x, 1, axis=axis + 1)


def _update_halves(x: jax.Array, axis: int, level: int, value: jax.Array, which: int, add: bool) -> jax.Array:
    """``x`` with the first (``which=0``) or second (1) halves of :func:`_halves` replaced by, or
    (``add``) incremented by, ``value``."""
    n = x.shape[axis]
    r = 2**level
    view = x.reshape(*x.shape[:axis], r, 2, n // (2 * r), *x.shape[axis + 1 :])
    index = (slice(None),) * (axis + 1) + (which,)
    view = view.at[index].add(value) if add else view.at[index].set(value)
    return view.reshape(x.shape)


def _pair_scores(q, k, visible):
    """float32 scores of a pair group, -inf where a key is not visible."""
    s = jnp.einsum("bkpmgqd,bkpsd->bkpmgqs", q, k, preferred_element_type=jnp.float32)
    return jnp.where(visible[:, None, :, :, None], s, -jnp.inf)


def _online_update(state, s, v):
    """Fold one pair group's scores ``s`` and values ``v`` into the running (max, denominator,
    output) of its query rows."""
    row_max, denominator, out = state
    new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # -inf: no visible key yet
    p = jnp.exp(s - safe_max[..., None])
    alpha = jnp.exp(row_max - safe_max)
    denominator = denominator * alpha + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkpmgqs,bkpsd->bkpmgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return new_max, denominator, out * alpha[..., None] + pv


def _pair_gradients(q, k, v, do, lse, delta, visible):
    """FlashAttention-2's backward for one pair group, scores recomputed: float32 (dq, dk, dv)
    (dq with respect to the scaled query)."""
    s = _pair_scores(q, k, visible)
    p = jnp.where(jnp.isfinite(s), jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    dtype = v.dtype
    dv = jnp.einsum("bkpmgqs,bkpmgqd->bkpsd", p.astype(dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkpmgqd,bkpsd->bkpmgqs", do, v, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None])).astype(dtype)
    dq = jnp.einsum("bkpmgqs,bkpsd->bkpmgqd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkpmgqs,bkpmgqd->bkpsd", ds, q, preferred_element_type=jnp.float32)
    return dq, dk, dv


class _Blocks:
    """One call's inputs cut into blocks.

    Aligned masks (a sequence attending to itself) use n = 2^L blocks of B slots, B close to
    ``block``. The lower block triangle is covered without computing any block above the
    diagonal: the n diagonal blocks, then for each level l < L the 2^l rectangles whose queries
    are the second half and whose keys are the first half of a run of 2m = n / 2^l blocks. All
    rectangles of a level have the same shape, so a level is one ``lax.scan`` over its m key-block
    columns, each step one batched matmul over n/2 block pairs; n - 1 steps in all, with
    temporaries of O(seq · B) that XLA reuses from step to step.

    Other masks compare all queries (one block) with one key block per ``lax.scan`` step.
    """

    def __init__(self, q, k, v, mask: AttentionMask, block: int):
        b, sq, nq, d = q.shape
        sk, nk = k.shape[1], k.shape[2]
        g = nq // nk
        self.sq, self.sk, self.nk, self.g = sq, sk, nk, g
        self.scale = d**-0.5
        self.mask = mask
        if mask.aligned:
            if sq != sk:
                raise ValueError(f"an aligned mask needs as many queries as keys, got {sq} and {sk}")
            n = 1 << max(0, math.ceil(math.log2(max(1, -(-sq // block)))))
            bq = -(-sq // n)
            if n > 1:
                bq = -(-bq // 8) * 8
            self.nq_blocks, self.bq, self.nk_blocks, self.bk = n, bq, n, bq
        else:
            bk = min(block, sk)
            self.nq_blocks, self.bq, self.nk_blocks, self.bk = 1, sq, -(-sk // bk), bk
        qp, kp = self.nq_blocks * self.bq, self.nk_blocks * self.bk
        self.q = self.query_blocks(q * jnp.asarray(self.scale, q.dtype))
        self.k = self._key_blocks(k)
        self.v = self._key_blocks(v)
        self.q_slots = pad_axis(mask.q_slots, 0, qp).reshape(self.nq_blocks, self.bq)
        self.k_slots = pad_axis(mask.k_slots, 0, kp).reshape(self.nk_blocks, self.bk)
        seg = mask.q_segments is not None
        self.q_seg = pad_axis(mask.q_segments, 1, qp).reshape(b, self.nq_blocks, self.bq) if seg else None
        self.k_seg = pad_axis(mask.k_segments, 1, kp).reshape(b, self.nk_blocks, self.bk) if seg else None
        valid = mask.k_valid
        if valid is None and kp != sk:
            valid = jnp.ones((b, sk), bool)
        self.k_valid = (
            None if valid is None else pad_axis(valid, 1, kp, False).reshape(b, self.nk_blocks, self.bk)
        )

    # -- layout --
    def query_blocks(self, x: jax.Array) -> jax.Array:
        """(b, sq, nq, ...) -> (b, nk, n, g, B, ...)"""
        b = x.shape[0]
        x = pad_axis(x, 1, self.nq_blocks * self.bq)
        x = x.reshape(b, self.nq_blocks, self.bq, self.nk, self.g, *x.shape[3:])
        return jnp.moveaxis(x, (3, 1, 4, 2), (1, 2, 3, 4))

    def query_rows(self, x: jax.Array) -> jax.Array:
        """(b, nk, n, g, B, ...) -> (b, sq, nq, ...)"""
        x = jnp.moveaxis(x, (1, 2, 3, 4), (3, 1, 4, 2))
        return x.reshape(x.shape[0], -1, self.nk * self.g, *x.shape[5:])[:, : self.sq]

    def _key_blocks(self, x: jax.Array) -> jax.Array:
        """(b, sk, nk, d) -> (b, nk, n, B, d)"""
        b, _, nk, d = x.shape
        x = pad_axis(x, 1, self.nk_blocks * self.bk)
        return x.reshape(b, self.nk_blocks, self.bk, nk, d).transpose(0, 3, 1, 2, 4)

    def key_rows(self, x: jax.Array) -> jax.Array:
        """(b, nk, n, B, d) -> (b, sk, nk, d)"""
        b, nk, n, bk, d = x.shape
        return x.transpose(0, 2, 3, 1, 4).reshape(b, n * bk, nk, d)[:, : self.sk]

    # -- the pair groups --
    @property
    def levels(self) -> int:
        return int(math.log2(self.nq_blocks)) if self.mask.aligned else 0

    def _visible(self, q_slots, k_slots, q_seg, k_seg, k_valid) -> jax.Array:
        return visible_keys(q_slots, k_slots, q_seg, k_seg, k_valid, self.mask.window)

    def diagonal_visible(self) -> jax.Array:
        """(b|1, n, 1, B, B): each diagonal block against itself."""

        def one(x):
            return None if x is None else jnp.expand_dims(x, -2)

        return self._visible(
            one(self.q_slots), one(self.k_slots), one(self.q_seg), one(self.k_seg), one(self.k_valid)
        )

    def level_columns(self, level: int):
        """Per key-block column (leading axis m) of level ``level``'s rectangles: keys and values
        (b, nk, 2^l, B, d), their slots (2^l, B), ids and validity (b, 2^l, B)."""
        keys = _halves(self.k, 2, level)[0]  # (b, nk, r, m, B, d)
        values = _halves(self.v, 2, level)[0]
        slots = _halves(self.k_slots, 0, level)[0]  # (r, m, B)
        seg = None if self.k_seg is None else _halves(self.k_seg, 1, level)[0]
        valid = None if self.k_valid is None else _halves(self.k_valid, 1, level)[0]
        return (
            jnp.moveaxis(keys, 3, 0),
            jnp.moveaxis(values, 3, 0),
            jnp.moveaxis(slots, 1, 0),
            None if seg is None else jnp.moveaxis(seg, 2, 0),
            None if valid is None else jnp.moveaxis(valid, 2, 0),
        )

    def level_visible(self, level: int, k_slots, k_seg, k_valid) -> jax.Array:
        """(b|1, 2^l, m, B, B): the second-half query blocks of each rectangle against one key
        block of its first half (k_slots (2^l, B), k_seg/k_valid (b, 2^l, B))."""
        q_slots = _halves(self.q_slots, 0, level)[1]
        q_seg = None if self.q_seg is None else _halves(self.q_seg, 1, level)[1]
        return self._visible(
            q_slots,
            k_slots[:, None],
            q_seg,
            None if k_seg is None else k_seg[:, :, None],
            None if k_valid is None else k_valid[:, :, None],
        )

    def column_skipped(self, level: int, column: jax.Array) -> jax.Array | None:
        """Traced bool: key column ``column`` of a level lies wholly outside the sliding window of
        every query of its rectangles (its nearest query is (m - column - 1) * B + 1 slots away)."""
        window = self.mask.window
        if window is None:
            return None
        m = self.nq_blocks // 2 ** (level + 1)
        nearest = (m - column - 1) * self.bq + 1
        return (window > 0) & (nearest >= window)

    def key_columns(self):
        """Non-aligned masks, per key block (leading axis): keys, values (b, nk, 1, B, d), slots
        (1, B), ids and validity (b, 1, B)."""

        def lead(x, axis):
            return None if x is None else jnp.expand_dims(jnp.moveaxis(x, axis, 0), axis + 1)

        return (
            lead(self.k, 2),
            lead(self.v, 2),
            lead(self.k_slots, 0),
            lead(self.k_seg, 1),
            lead(self.k_valid, 1),
        )

    def all_queries_visible(self, k_slots, k_seg, k_valid) -> jax.Array:
        """(b|1, 1, 1, sq, B): every query against one key block (non-aligned masks)."""
        return self._visible(
            self.q_slots[None],
            k_slots[:, None],
            None if self.q_seg is None else self.q_seg[:, None],
            None if k_seg is None else k_seg[:, :, None],
            None if k_valid is None else k_valid[:, :, None],
        )


def _skippable(skip: jax.Array | None, run, skipped, *operands):
    """``run(*operands)``, or ``skipped(*operands)`` when the traced ``skip`` is true."""
    if skip is None:
        return run(*operands)
    return jax.lax.cond(skip, skipped, run, *operands)


def _forward(blocks: _Blocks):
    """(output (b, nk, n, g, B, d), lse (b, nk, n, g, B)), both float32, in block layout."""
    q, k, v = blocks.q, blocks.k, blocks.v
    # Built from q (``*_like``) so that, inside ``shard_map``, the loop state varies over the same
    # mesh axes as the inputs.
    o0 = jnp.zeros_like(q, jnp.float32)
    m0 = jnp.full_like(o0[..., 0], -jnp.inf)
    state = (m0, jnp.zeros_like(m0), o0)
    if blocks.mask.aligned:
        diagonal = _online_update(
            tuple(x[:, :, :, None] for x in state),
            _pair_scores(q[:, :, :, None], k, blocks.diagonal_visible()),
            v,
        )
        state = tuple(x[:, :, :, 0] for x in diagonal)
        for level in range(blocks.levels):
            queries = _halves(q, 2, level)[1]  # (b, nk, r, m, g, B, d)
            part = tuple(_halves(x, 2, level)[1] for x in state)

            def column(part, inputs, level=level, queries=queries):
                index, k_j, v_j, slots, seg, valid = inputs

                def run(part):
                    visible = blocks.level_visible(level, slots, seg, valid)
                    return _online_update(part, _pair_scores(queries, k_j, visible), v_j)

                return _skippable(blocks.column_skipped(level, index), run, lambda p: p, part), None

            columns = blocks.level_columns(level)
            steps = jnp.arange(columns[0].shape[0])
            part, _ = jax.lax.scan(column, part, (steps, *columns))
            state = tuple(_update_halves(x, 2, level, y, 1, False) for x, y in zip(state, part, strict=True))
    else:

        def key_block(state, inputs):
            k_j, v_j, slots, seg, valid = inputs
            visible = blocks.all_queries_visible(slots, seg, valid)
            part = tuple(x[:, :, :, None] for x in state)
            new = _online_update(part, _pair_scores(q[:, :, :, None], k_j, visible), v_j)
            return tuple(x[:, :, :, 0] for x in new), None

        state, _ = jax.lax.scan(key_block, state, blocks.key_columns())
    row_max, denominator, out = state
    seen = denominator > 0
    safe = jnp.where(seen, denominator, 1.0)
    out = jnp.where(seen[..., None], out / safe[..., None], 0.0)
    lse = jnp.where(seen, row_max + jnp.log(safe), -jnp.inf)
    return out, lse


def _backward(blocks: _Blocks, out, lse, d_out, d_lse):
    """Gradients with every block's scores recomputed, in the forward's order of pair groups.
    out, d_out: (b, nk, n, g, B, d) float32; lse, d_lse: (b, nk, n, g, B). Returns float32
    (dq, dk, dv) in block layout, dq with respect to the unscaled query."""
    q, k, v = blocks.q, blocks.k, blocks.v
    # d lse / d s = softmax: the log-sum-exp's cotangent enters as a shift of the row term.
    delta = jnp.sum(d_out * out, axis=-1) - d_lse
    do = d_out.astype(v.dtype)
    if blocks.mask.aligned:
        dq, dk, dv = _pair_gradients(
            q[:, :, :, None],
            k,
            v,
            do[:, :, :, None],
            lse[:, :, :, None],
            delta[:, :, :, None],
            blocks.diagonal_visible(),
        )
        dq = dq[:, :, :, 0]
        for level in range(blocks.levels):
            rows = tuple(_halves(x, 2, level)[1] for x in (q, do, lse, delta))

            def column(dq_part, inputs, level=level, rows=rows):
                index, k_j, v_j, slots, seg, valid = inputs

                def run(dq_part):
                    visible = blocks.level_visible(level, slots, seg, valid)
                    dq_j, dk_j, dv_j = _pair_gradients(rows[0], k_j, v_j, *rows[1:], visible)
                    return dq_part + dq_j, dk_j, dv_j

                def skipped(dq_part):
                    return dq_part, jnp.zeros_like(k_j, jnp.float32), jnp.zeros_like(v_j, jnp.float32)

                dq_part, dk_j, dv_j = _skippable(blocks.column_skipped(level, index), run, skipped, dq_part)
                return dq_part, (dk_j, dv_j)

            columns = blocks.level_columns(level)
            steps = jnp.arange(columns[0].shape[0])
            # Start from the query gradient so far: each level waits for the previous one, so XLA
            # never runs two levels' loops (and holds their temporaries) at the same time.
            dq_part = _halves(dq, 2, level)[1]
            dq_part, (dk_cols, dv_cols) = jax.lax.scan(column, dq_part, (steps, *columns))
            dq = _update_halves(dq, 2, level, dq_part, 1, False)
            # (m, b, nk, r, B, d) -> (b, nk, r, m, B, d): the first halves' key blocks
            dk = _update_halves(dk, 2, level, jnp.moveaxis(dk_cols, 0, 3), 0, True)
            dv = _update_halves(dv, 2, level, jnp.moveaxis(dv_cols, 0, 3), 0, True)
    else:

        def key_block(dq, inputs):
            k_j, v_j, slots, seg, valid = inputs
            visible = blocks.all_queries_visible(slots, seg, valid)
            dq_j, dk_j, dv_j = _pair_gradients(
                q[:, :, :, None],
                k_j,
                v_j,
                do[:, :, :, None],
                lse[:, :, :, None],
                delta[:, :, :, None],
                visible,
            )
            return dq + dq_j[:, :, :, 0], (dk_j[:, :, 0], dv_j[:, :, 0])

        dq = jnp.zeros_like(q, jnp.float32)
        dq, (dk, dv) = jax.lax.scan(key_block, dq, blocks.key_columns())
        dk, dv = jnp.moveaxis(dk, 0, 2), jnp.moveaxis(dv, 0, 2)
    return dq * blocks.scale, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, mask, block, out_dtype):
    return _flash_forward(q, k, v, mask, block, out_dtype)[0]


def _flash_forward(q, k, v, mask, block, out_dtype):
    blocks = _Blocks(q, k, v, mask, block)
    out, lse = _forward(blocks)
    result = (blocks.query_rows(out).astype(out_dtype), blocks.query_rows(lse))
    return result, (q, k, v, mask, out, lse)


def _flash_backward(block, out_dtype, residuals, cotangents):
    q, k, v, mask, out, lse = residuals
    d_out, d_lse = cotangents
    blocks = _Blocks(q, k, v, mask, block)
    dq, dk, dv = _backward(
        blocks, out, lse, blocks.query_blocks(d_out.astype(jnp.float32)), blocks.query_blocks(d_lse)
    )
    no_gradient = jax.tree.map(lambda _: None, mask)  # positions and ids are not differentiable
    return (
        blocks.query_rows(dq).astype(q.dtype),
        blocks.key_rows(dk).astype(k.dtype),
        blocks.key_rows(dv).astype(v.dtype),
        no_gradient,
    )


_flash.defvjp(_flash_forward, _flash_backward)


def blocked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    *,
    block: int = 128,
    out_dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Flash-style attention. q: (batch, seq_q, nq, d); k, v: (batch, seq_k, nk, d).

    Returns (out (batch, seq_q, nq, d) in ``out_dtype`` (default q's), lse (batch, seq_q, nq)
    float32 log-sum-exp of each row's visible scores, -inf for a row that sees no key). ``block``:
    the key block length (aligned masks: about this many slots per block, so that the number of
    blocks is a power of two). Equal to
    :func:`zaya_jax.ops.attention.dense.dot_product_attention` in value and gradient;
    memory is O(seq · block), not O(seq²).
    """
    if (mask.q_segments is None) != (mask.k_segments is None):
        raise ValueError("AttentionMask needs both q_segments and k_segments, or neither")
    if block < 1:
        raise ValueError(f"attention block length must be >= 1, got {block}")
    return _flash(q, k, v, mask, int(block), jnp.dtype(out_dtype or q.dtype))
