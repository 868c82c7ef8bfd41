"""Causal GQA softmax attention (spec §2.3 step 7): the mask description, the kernels and the
dispatcher, one layer each; a module imports only modules of the layers below its own.

* bottom, :mod:`~zaya_jax.ops.attention.masks`: :class:`AttentionMask` (which keys a query may see,
  as positions and ids, never a (seq_q, seq_k) array), the fused kernels' argument checks and the
  mask as per-row vectors, and the padding helper the kernels share;
* the kernels, each its own module: :mod:`~zaya_jax.ops.attention.dense` (the definition, the
  reference in tests), :mod:`~zaya_jax.ops.attention.blocked` (flash-style in plain JAX, memory
  linear in the sequence: the default and the reference of the fused kernels),
  :mod:`~zaya_jax.ops.attention.cpu` (the fused CPU custom call, which falls back to the blocked
  kernel), :mod:`~zaya_jax.ops.attention.pallas` (the fused Pallas/Triton GPU kernel) and
  :mod:`~zaya_jax.ops.attention.cudnn` (``jax.nn.dot_product_attention``, causal masks only);
* top, :mod:`~zaya_jax.ops.attention.dispatch`: :func:`attention` (``impl=...``).

A query row that may see no key at all (a padding position) gets a zero output and a log-sum-exp
of -inf in every implementation.

Why not a library kernel: ``jax.nn.dot_product_attention`` has no document (segment id) masks
except as a dense (seq, seq) mask, and its cuDNN path exists only on NVIDIA GPUs; Pallas/Triton
kernels do not run on XLA:CPU. The portable blocked kernel is the default and the reference; the
fused kernels sit behind :func:`attention` with the same mask description.

This package re-exports the names below; the fused kernels are imported from their modules
(:func:`zaya_jax.ops.attention.cpu.cpu_attention`, :func:`zaya_jax.ops.attention.pallas.pallas_attention`).
"""

from zaya_jax.ops.attention.blocked import blocked_attention
from zaya_jax.ops.attention.dense import HIDDEN, dot_product_attention
from zaya_jax.ops.attention.dispatch import Impl, attention
from zaya_jax.ops.attention.masks import (
    FAR,
    NO_DOCUMENT,
    AttentionMask,
    check_fused_inputs,
    mask_rows,
    self_attention_mask,
)

__all__ = [
    "FAR",
    "HIDDEN",
    "NO_DOCUMENT",
    "AttentionMask",
    "Impl",
    "attention",
    "blocked_attention",
    "check_fused_inputs",
    "dot_product_attention",
    "mask_rows",
    "self_attention_mask",
]
