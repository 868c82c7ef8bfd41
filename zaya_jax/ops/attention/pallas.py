"""A fused attention kernel for GPUs in Pallas (Triton lowering), with CCA's whole mask description:
causal slots, document (segment) ids, padding keys, a sliding window, and GQA without repeating
K/V (each query head's program reads its KV head through the BlockSpec index map). Returns the
output and the natural-log log-sum-exp per row (the ring merges partial results with it), with a
``custom_vjp`` whose backward is two more Pallas kernels (dq; dk and dv) that recompute the scores.

Written after JAX's reference kernel (``jax/experimental/pallas/ops/gpu/attention.py``: FlashAttention-2
forward, Triton-tutorial backward), which has causal and segment masks only, repeats nothing for
GQA only by taking equal head counts, has no log-sum-exp cotangent and no window; those are why it
is not used directly. The mask enters as per-row integer vectors, never a (seq, seq) array:

* ``q_slot``/``k_slot``: a key is visible when ``k_slot <= q_slot`` and ``k_slot >= q_low``, where
  ``q_low = q_slot - window + 1`` (a very negative number without a window);
* ``q_seg``/``k_seg``: same document; a padding key gets a segment no query has.

For aligned masks (a sequence attending to itself) each query block walks only the key blocks
that can hold a visible key (from the diagonal back to the window's start), and each key block of
the backward only the query blocks that can see it: fully masked blocks are skipped, not masked.
Rows that see no key give a zero output and a log-sum-exp of -inf, as in the blocked kernel.

On CPU the kernels run in Pallas interpret mode (tests; slow), and while planning a GPU program
on CPU the blocked kernel stands in (``pallas_attention_gpu_twin``: the same linear memory; chosen
by the dispatcher, :mod:`zaya_jax.ops.attention.dispatch`). The per-row vectors are
:func:`zaya_jax.ops.attention.masks.mask_rows`; this module imports nothing else of the package.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zaya_jax.ops.attention.masks import FAR, check_fused_inputs, mask_rows, pad_axis


class _Static(NamedTuple):
    block_q: int
    block_k: int
    aligned: bool
    interpret: bool
    scale: float


def _visible(q_slot, q_low, q_seg, k_slot, k_seg):
    return (
        (k_slot[None, :] <= q_slot[:, None])
        & (k_slot[None, :] >= q_low[:, None])
        & (q_seg[:, None] == k_seg[None, :])
    )


def _key_block_range(q_slot, q_low, block_k: int, num_k: int, aligned: bool):
    if not aligned:
        return 0, num_k
    lo = jnp.maximum(jnp.min(q_low), 0) // block_k
    hi = jnp.minimum(jnp.maximum(jnp.max(q_slot), -1) // block_k + 1, num_k)
    return lo, jnp.maximum(hi, lo)


def _forward_kernel(q_ref, k_ref, v_ref, qslot_ref, qlow_ref, qseg_ref, kslot_ref, kseg_ref, o_ref, lse_ref,
                    *, scale: float, block_k: int, aligned: bool):  # fmt: skip
    q = q_ref[...]
    q_slot, q_low, q_seg = qslot_ref[...], qlow_ref[...], qseg_ref[...]
    rows = q.shape[0]

    def body(j, carry):
        acc, row_max, denominator = carry
        keys = pl.ds(j * block_k, block_k)
        s = plgpu.dot(q, k_ref[keys, :], trans_b=True) * scale
        s = jnp.where(_visible(q_slot, q_low, q_seg, kslot_ref[keys], kseg_ref[keys]), s, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
        safe = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        p = jnp.exp(s - safe[:, None])
        alpha = jnp.exp(row_max - safe)
        v = v_ref[keys, :]
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, new_max, denominator * alpha + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((rows, q.shape[1]), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    lo, hi = _key_block_range(q_slot, q_low, block_k, k_ref.shape[0] // block_k, aligned)
    acc, row_max, denominator = lax.fori_loop(lo, hi, body, init)
    seen = denominator > 0
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, denominator, 1.0)[:, None], 0.0).astype(
        o_ref.dtype
    )
    lse_ref[...] = jnp.where(seen, row_max + jnp.log(jnp.where(seen, denominator, 1.0)), -jnp.inf)


def _probabilities(q, k, lse, visible, scale):
    s = plgpu.dot(q, k, trans_b=True) * scale
    return jnp.where(visible, jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse)[:, None]), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, qslot_ref, qlow_ref, qseg_ref, kslot_ref, kseg_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *, scale: float, block_k: int, aligned: bool):  # fmt: skip
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_slot, q_low, q_seg = qslot_ref[...], qlow_ref[...], qseg_ref[...]

    def body(j, dq):
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        p = _probabilities(q, k, lse, _visible(q_slot, q_low, q_seg, kslot_ref[keys], kseg_ref[keys]), scale)
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    lo, hi = _key_block_range(q_slot, q_low, block_k, k_ref.shape[0] // block_k, aligned)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qslot_ref, qlow_ref, qseg_ref, kslot_ref, khigh_ref, kseg_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, *, scale: float, block_q: int, aligned: bool):  # fmt: skip
    k, v = k_ref[...], v_ref[...]
    k_slot, k_seg = kslot_ref[...], kseg_ref[...]

    def body(i, carry):
        dk, dv = carry
        queries = pl.ds(i * block_q, block_q)
        q, do = q_ref[queries, :], do_ref[queries, :]
        visible = _visible(qslot_ref[queries], qlow_ref[queries], qseg_ref[queries], k_slot, k_seg)
        p = _probabilities(q, k, lse_ref[queries], visible, scale)
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta_ref[queries][:, None])
        return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

    num_q = q_ref.shape[0] // block_q
    if aligned:  # queries from the block's first key to the last one its window reaches
        lo = jnp.minimum(jnp.min(k_slot), FAR) // block_q
        hi = jnp.minimum(jnp.minimum(jnp.max(khigh_ref[...]), FAR) // block_q + 1, num_q)
        lo, hi = jnp.minimum(lo, num_q), jnp.maximum(hi, jnp.minimum(lo, num_q))
    else:
        lo, hi = 0, num_q
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret: bool, name: str):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2),
        name=name,
    )


def _forward(q, k, v, rows, *, block_q, block_k, aligned, interpret, scale):
    """rows: (q_slot, q_low, q_seg, k_slot, k_high, k_seg), padded to the blocks."""
    q_slot, q_low, q_seg, k_slot, _, k_seg = rows
    batch, seq_q, heads, width = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    kv = pl.BlockSpec((None, seq_k, None, width), lambda i, b, h: (b, 0, h // groups, 0))
    q_rows = pl.BlockSpec((None, block_q, None, width), lambda i, b, h: (b, i, h, 0))
    in_specs = [
        q_rows, kv, kv,
        pl.BlockSpec((block_q,), lambda i, b, h: (i,)), pl.BlockSpec((block_q,), lambda i, b, h: (i,)),
        pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
        pl.BlockSpec((seq_k,), lambda i, b, h: (0,)), pl.BlockSpec((None, seq_k), lambda i, b, h: (b, 0)),
    ]  # fmt: skip
    out_specs = [q_rows, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))]
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32),
    ]
    kernel = functools.partial(_forward_kernel, scale=scale, block_k=block_k, aligned=aligned)
    grid = (seq_q // block_q, batch, heads)
    return _call(kernel, grid, in_specs, out_specs, out_shape, interpret, "zaya_attention_forward")(
        q, k, v, q_slot, q_low, q_seg, k_slot, k_seg
    )


def _backward(q, k, v, rows, out, lse, d_out, d_lse, *, block_q, block_k, aligned, interpret, scale):
    q_slot, q_low, q_seg, k_slot, k_high, k_seg = rows
    batch, seq_q, heads, width = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    # FlashAttention-2's delta, less the log-sum-exp's cotangent (d lse / d s = p)
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), d_out.astype(jnp.float32)) - d_lse
    d_out = d_out.astype(q.dtype)
    whole_kv = pl.BlockSpec((None, seq_k, None, width), lambda i, b, h: (b, 0, h // groups, 0))
    q_rows = pl.BlockSpec((None, block_q, None, width), lambda i, b, h: (b, i, h, 0))
    row_vec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
    dq = _call(
        functools.partial(_dq_kernel, scale=scale, block_k=block_k, aligned=aligned),
        (seq_q // block_q, batch, heads),
        [q_rows, whole_kv, whole_kv,
         pl.BlockSpec((block_q,), lambda i, b, h: (i,)), pl.BlockSpec((block_q,), lambda i, b, h: (i,)),
         pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
         pl.BlockSpec((seq_k,), lambda i, b, h: (0,)), pl.BlockSpec((None, seq_k), lambda i, b, h: (b, 0)),
         q_rows, row_vec, row_vec],
        q_rows, jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, "zaya_attention_dq",
    )(q, k, v, q_slot, q_low, q_seg, k_slot, k_seg, d_out, lse, delta)  # fmt: skip
    whole_q = pl.BlockSpec((None, seq_q, None, width), lambda j, b, h: (b, 0, h, 0))
    k_rows = pl.BlockSpec((None, block_k, None, width), lambda j, b, h: (b, j, h // groups, 0))
    per_head = pl.BlockSpec((None, block_k, None, width), lambda j, b, h: (b, j, h, 0))
    whole_vec = pl.BlockSpec((None, None, seq_q), lambda j, b, h: (b, h, 0))
    shape = jax.ShapeDtypeStruct((batch, seq_k, heads, width), jnp.float32)
    dk, dv = _call(
        functools.partial(_dkv_kernel, scale=scale, block_q=block_q, aligned=aligned),
        (seq_k // block_k, batch, heads),
        [whole_q, k_rows, k_rows,
         pl.BlockSpec((seq_q,), lambda j, b, h: (0,)), pl.BlockSpec((seq_q,), lambda j, b, h: (0,)),
         pl.BlockSpec((None, seq_q), lambda j, b, h: (b, 0)),
         pl.BlockSpec((block_k,), lambda j, b, h: (j,)), pl.BlockSpec((block_k,), lambda j, b, h: (j,)),
         pl.BlockSpec((None, block_k), lambda j, b, h: (b, j)),
         whole_q, whole_vec, whole_vec],
        [per_head, per_head], [shape, shape], interpret, "zaya_attention_dkv",
    )(q, k, v, q_slot, q_low, q_seg, k_slot, k_high, k_seg, d_out, lse, delta)  # fmt: skip
    # each query head's share, summed over the heads of its KV head (no K/V was repeated)
    dk = dk.reshape(batch, seq_k, kv_heads, groups, width).sum(3).astype(k.dtype)
    dv = dv.reshape(batch, seq_k, kv_heads, groups, width).sum(3).astype(v.dtype)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(q, k, v, rows, static):
    return _forward(q, k, v, rows, **static._asdict())


def _fused_forward(q, k, v, rows, static):
    out, lse = _forward(q, k, v, rows, **static._asdict())
    return (out, lse), (q, k, v, rows, out, lse)


def _fused_backward(static, residuals, cotangents):
    q, k, v, rows, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, rows, out, lse, *cotangents, **static._asdict())
    return dq, dk, dv, jax.tree.map(lambda _: None, rows)


_fused.defvjp(_fused_forward, _fused_backward)


def pallas_attention(q, k, v, mask, *, block_q: int = 64, block_k: int = 64, interpret: bool | None = None):
    """Fused attention. q: (batch, seq_q, nq, d); k, v: (batch, seq_k, nk, d); ``mask``: an
    :class:`zaya_jax.ops.attention.masks.AttentionMask`. Returns (out (batch, seq_q, nq, d) in q's dtype,
    lse (batch, seq_q, nq) float32), equal to the blocked kernel in value and gradient.
    ``interpret``: Pallas interpret mode (default: on a CPU backend)."""
    check_fused_inputs(q, k, mask)
    batch, seq_q, _, width = q.shape
    seq_k = k.shape[1]
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    block_q, block_k = (
        min(b, max(16, pl.next_power_of_2(s))) for b, s in ((block_q, seq_q), (block_k, seq_k))
    )
    padded_q, padded_k = (math.ceil(s / b) * b for s, b in ((seq_q, block_q), (seq_k, block_k)))
    padded_width = max(16, pl.next_power_of_2(width))  # Triton's dot needs >= 16 and a power of 2
    rows = mask_rows(mask, batch, seq_q, seq_k, padded_q, padded_k)
    q_p = pad_axis(pad_axis(q, 1, padded_q, 0), 3, padded_width, 0)
    k_p, v_p = (pad_axis(pad_axis(x, 1, padded_k, 0), 3, padded_width, 0) for x in (k, v))
    static = _Static(block_q, block_k, bool(mask.aligned), bool(interpret), width**-0.5)
    out, lse = _fused(q_p, k_p, v_p, rows, static)
    return out[:, :seq_q, :, :width], lse[:, :, :seq_q].transpose(0, 2, 1)
