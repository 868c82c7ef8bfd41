"""The dense definition of CCA's softmax attention (spec §2.3 step 7), the reference every kernel of
the package is tested against: it materialises the (seq_q, seq_k) scores, so it serves short
sequences (the dispatcher runs it for a sequence within one block), decoding and the tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIDDEN = -1e30
"""The additive score bias of a hidden key: exp(HIDDEN - max) is exactly 0 in float32 for any
finite score, and unlike -inf it keeps a row of only hidden keys finite (its output is zeroed)."""


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """The definition: scores q·k^T · d^-1/2 in float32, softmax over visible keys, times v.

    q: (batch, seq, nq, d); k, v: (batch, seq_k, nk, d); mask: (batch|1, seq, seq_k) bool.
    Returns (batch, seq, nq * d); rows with no visible key are zero. The g = nq/nk query heads of a
    KV head are stacked along the query axis, so both products are plain batched matmuls. The
    scale is folded into q and the mask enters as an additive bias (hidden keys get exp(-1e30) = 0),
    so neither the forward nor the backward pass selects element by element over the scores.
    """
    batch, seq, nq, d = q.shape
    seq_k, nk = k.shape[1], k.shape[2]
    groups = nq // nk
    q = q * jnp.asarray(d**-0.5, q.dtype)
    q = q.reshape(batch, seq, nk, groups, d).transpose(0, 2, 3, 1, 4).reshape(batch, nk, groups * seq, d)
    scores = jnp.einsum("bkqd,bksd->bkqs", q, k.transpose(0, 2, 1, 3), preferred_element_type=jnp.float32)
    bias = jnp.where(mask, 0.0, HIDDEN)[:, None, None]  # (b|1, 1, 1, seq, seq_k)
    scores = scores.reshape(batch, nk, groups, seq, seq_k) + bias
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(batch, nk, groups * seq, seq_k)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v.transpose(0, 2, 1, 3))
    out = out.reshape(batch, nk, groups, seq, d).transpose(0, 3, 1, 2, 4).reshape(batch, seq, nq * d)
    sees_a_key = jnp.any(mask, axis=-1)[..., None]  # (b|1, seq, 1): a row of only hidden keys -> 0
    return out * sees_a_key.astype(out.dtype)


def few_query_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """The definition for a few queries per row (decoding), as products and sums over the head
    dimension instead of batched matmuls: with 1-8 query rows per KV head the matmuls are too small
    to feed a CPU's matrix units (``bench/RESULTS.md``). Shapes and result as
    :func:`dot_product_attention`; keys and values are read as (batch, nk, seq_k, d), the decode
    cache's layout."""
    batch, seq, nq, d = q.shape
    nk, dtype = k.shape[2], v.dtype
    groups = nq // nk
    q = (q * jnp.asarray(d**-0.5, q.dtype)).reshape(batch, seq, nk, groups, d)
    q = q.transpose(0, 2, 3, 1, 4).astype(jnp.float32)  # (b, k, g, t, d)
    k, v = (x.transpose(0, 2, 1, 3).astype(jnp.float32) for x in (k, v))  # (b, k, s, d)
    scores = jnp.sum(q[:, :, :, :, None, :] * k[:, :, None, None], axis=-1)  # (b, k, g, t, s)
    bias = jnp.where(mask, 0.0, HIDDEN)[:, None, None]  # (b|1, 1, 1, t, s)
    probs = jax.nn.softmax(scores + bias, axis=-1)
    out = jnp.sum(probs[..., None] * v[:, :, None, None], axis=-2)  # (b, k, g, t, d)
    out = out * jnp.any(mask, axis=-1)[:, None, None, :, None]  # a row of only hidden keys -> 0
    return out.transpose(0, 3, 1, 2, 4).astype(dtype).reshape(batch, seq, nq * d)
