"""The top of the attention package: :func:`attention` (``impl=...``), which picks one of the kernels
below it (:mod:`~zaya_jax.ops.attention.dense`, :mod:`~zaya_jax.ops.attention.blocked`,
:mod:`~zaya_jax.ops.attention.cpu`, :mod:`~zaya_jax.ops.attention.pallas`,
:mod:`~zaya_jax.ops.attention.cudnn`) for CCA's attention, and the blocked kernel as the Pallas
kernel's memory twin while a GPU program is planned on CPU. No kernel imports this module.
"""

from __future__ import annotations

from typing import Literal

import jax

from zaya_jax.ops.attention.blocked import blocked_attention
from zaya_jax.ops.attention.cpu import cpu_attention
from zaya_jax.ops.attention.cudnn import cudnn_attention
from zaya_jax.ops.attention.dense import dot_product_attention, few_query_attention
from zaya_jax.ops.attention.masks import AttentionMask
from zaya_jax.ops.platform import planning_gpu_on_cpu

Impl = Literal["auto", "blocked", "dense", "pallas", "cudnn", "cpu"]

CPU_DENSE_MAX = 64
"""The longest self-attending sequence that ``impl="cpu"`` runs as the dense definition: one key
block of the custom call (``kBlockK`` in ``custom_calls/cpu/attention_cpu.cc``)."""


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, *, impl: Impl = "blocked", block: int = 128
) -> jax.Array:
    """CCA's attention: (batch, seq_q, nq * d). ``impl``: "blocked" (default, memory linear in the
    sequence), "dense" (the definition; materialises the (seq_q, seq_k) scores), "pallas" (the
    fused GPU kernel, :mod:`zaya_jax.ops.attention.pallas`), "cpu" (the fused CPU custom call,
    :mod:`zaya_jax.ops.attention.cpu`; the blocked kernel on other devices) or "cudnn"
    (``jax.nn.dot_product_attention``, causal masks only). "auto" is resolved by the program's
    kernel plan (:mod:`zaya_jax.ops.kernel_plan`); unresolved here it is blocked.

    A sequence attending to itself that fits in one block has no block to skip and no tile to
    loop over: "blocked" then runs the dense definition, whose autodiff keeps the one block of
    probabilities for the backward pass instead of recomputing it (the same memory as the kernel's
    one block; 0.7x the CCA layer's time at 16 x 128 on CPU, where the kernel's layout changes
    around its custom_vjp do not fuse with their neighbours). "cpu" does the same within one of its
    own 64-key blocks (:data:`CPU_DENSE_MAX`), where the custom call's forward and backward of the
    ``tiny`` model take 1.07x (16 x 32) and 1.01x (4 x 64) the dense definition's time; from two
    blocks on it skips the masked half (16 x 128: 0.93x). A mask with per-row query slots (a
    slot cache, :attr:`AttentionMask.per_row`: a few new tokens per row against the cache) also
    runs the dense definition, whatever ``impl`` (as products and sums for up to 8 query rows per
    KV head, :func:`~zaya_jax.ops.attention.dense.few_query_attention`)."""
    batch, seq, nq, d = q.shape
    if mask.per_row:  # a slot cache's rows at their own offsets (decoding a few tokens per row)
        few = seq * nq // k.shape[2] <= 8
        return (few_query_attention if few else dot_product_attention)(q, k, v, mask.dense())
    if impl == "pallas":
        out = _pallas_or_twin(q, k, v, mask, block)
        return out.reshape(batch, seq, nq * d)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, mask).reshape(batch, seq, nq * d)
    one_block = CPU_DENSE_MAX if impl == "cpu" else block
    if impl == "dense" or (mask.aligned and seq <= one_block):
        return dot_product_attention(q, k, v, mask.dense())
    if impl == "cpu":
        return cpu_attention(q, k, v, mask, block=block)[0].reshape(batch, seq, nq * d)
    out, _ = blocked_attention(q, k, v, mask, block=block)
    return out.reshape(batch, seq, nq * d)


def _pallas_or_twin(q, k, v, mask, block):
    """The fused Pallas kernel (:mod:`zaya_jax.ops.attention.pallas`; interpret mode on a CPU
    backend); while planning a GPU program on CPU, which cannot compile Triton, the blocked kernel
    stands in with the same linear memory."""
    # Imported here only for its cost (Pallas and its Triton lowering, ~0.1 s), paid by the programs
    # that take this kernel; the module imports nothing above the masks, so this closes no circle.
    from zaya_jax.ops.attention.pallas import pallas_attention

    if planning_gpu_on_cpu():
        with jax.named_scope("pallas_attention_gpu_twin"):
            return blocked_attention(q, k, v, mask, block=block)[0]
    return pallas_attention(q, k, v, mask, block_q=min(block, 128), block_k=min(block, 128))[0]
