"""Attention inputs, masks and the error measure of tests/ops/test_attention.py, shared by the CPU
and Pallas kernels' tests (tests/ops/test_cpu_attention.py, tests/ops/test_pallas_attention.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from zaya_jax.ops.attention import AttentionMask, self_attention_mask

RTOL = 1e-5  # fp32, relative to the largest entry of each compared array


def _inputs(batch, seq, nq, nk, d=8, seq_k=None, seed=0):
    rng = np.random.default_rng(seed)
    seq_k = seq_k or seq
    q = jnp.asarray(rng.standard_normal((batch, seq, nq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, seq_k, nk, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, seq_k, nk, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((batch, seq, nq * d)), jnp.float32)  # a non-trivial cotangent
    return q, k, v, w


def _mask(kind: str, batch: int, seq: int) -> AttentionMask:
    segments = np.ones((batch, seq), np.int32)
    valid = np.ones((batch, seq), bool)
    if kind in ("documents", "all"):
        segments[:, seq // 3 :] = 2
        segments[0, 2 * seq // 3 :] = 3  # a third document in row 0, a boundary inside a block
    if kind in ("padding", "all"):
        valid[0, :5] = False  # left padding
        valid[-1, seq - 3 :] = False  # right padding
    mask = self_attention_mask(
        seq,
        jnp.asarray(segments) if kind in ("documents", "all") else None,
        jnp.asarray(valid) if kind in ("padding", "all") else None,
    )
    if kind in ("window", "all"):
        mask = mask.replace(window=jnp.int32(5))
    return mask


def _max_rel_error(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def prefill_case():
    """Not aligned: 6 new tokens at slots 17..22 of a 29-slot cache whose first slots are padding
    (the prefill/decode shape), with a sliding window: (q, k, v, w, mask)."""
    q, k, v, w = _inputs(2, 6, 4, 2, seq_k=29)
    valid = np.ones((2, 29), bool)
    valid[1, :4] = False
    mask = AttentionMask(
        q_slots=jnp.arange(17, 23, dtype=jnp.int32),
        k_slots=jnp.arange(29, dtype=jnp.int32),
        k_valid=jnp.asarray(valid),
        window=jnp.int32(9),
    )
    return q, k, v, w, mask
