"""Next-token cross-entropy straight from the final hidden states, chunk by chunk: the LM head's
(tokens, vocab) float32 logits are never held whole, neither in the forward pass nor in the
backward (spec §2.1's tied head; with ZAYA1's 262,144-token vocabulary one 4,096-token row of
logits is 4.3 GB).

A ``lax.scan`` walks over chunks of sequence positions; each step computes one chunk's logits in
float32, its log-partition and the target logit. Chunks take every ``n_chunks``-th position of
every row, so the batch axis (and a contiguous context split of the sequence) keeps its sharding
inside each step. The ``custom_vjp`` keeps only the per-token log-partition and recomputes the
logits in the backward pass, where ``d logits = softmax * (g_ce + g_lse) - onehot(target) * g_ce``
gives the hidden-state gradient and the head's weight (and bias) gradient. On one device it walks
tiles of the vocabulary (:func:`vocab_tiles`), each writing its own rows of the head's gradient in
place; on a mesh (the step passes ``vocab_tiling=False``), under a sampler's top-k or top-p (which
need whole rows of logits) or with the sequence in one chunk, it walks the forward's position
chunks, each adding a (vocab, embed) product to the head's gradient: one more head-sized buffer.

With a sampling ``distribution`` (temperature, top-k, top-p) and a vocabulary limit the same scan
gives each target's negative log-probability under the distribution a sampler drew it from
(:mod:`zaya_jax.ops.sampling_filter`; the target itself always counts as kept, so a token at the
edge of top-p is never -inf for float rounding between sampler and trainer): GRPO's ratio. The
filter's choice of tokens is a constant of the gradient, as in every sampler.

Written here rather than taken from a library: optax's ``softmax_cross_entropy_with_integer_labels``
needs the full logits, and the blockwise losses of MaxText and Levanter are tied to their model
and array types. The same scheme as theirs (vocabulary tiling), in plain JAX.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from zaya_jax.ops.sampling_filter import processed_logits

MODEL_DISTRIBUTION = (1.0, 0, 1.0)
"""(temperature, top_k, top_p) of the model's own distribution: plain cross-entropy."""

LOGITS_BUDGET = 2**24
"""Float32 logits per chunk that ``auto_chunk`` aims for (64 MiB) per sequence row."""


def auto_chunk(vocab_size: int) -> int:
    """Positions per chunk when the config says 0: the largest multiple of 16 whose logits for one
    row stay within :data:`LOGITS_BUDGET` elements (48 for ZAYA1's 262,272-token vocabulary),
    at least 16."""
    return max(16, LOGITS_BUDGET // vocab_size // 16 * 16)


def head_logits(h: jax.Array, weight: jax.Array, bias: jax.Array | None, vocab_axis: int) -> jax.Array:
    """(batch, seq, vocab) float32 logits of (batch, seq, embed) hidden states under the LM head
    ``weight`` ((vocab, embed) when ``vocab_axis`` is 0, else (embed, vocab)) and ``bias``."""
    spec = "bte,ve->btv" if vocab_axis == 0 else "bte,ev->btv"
    logits = jnp.einsum(spec, h, weight, preferred_element_type=jnp.float32)
    return logits if bias is None else logits + bias.astype(jnp.float32)


def _strided_chunks(x: jax.Array, n_chunks: int, length: int) -> jax.Array:
    """(batch, seq, ...) -> (n_chunks, batch, length, ...): chunk c holds positions c, c + n_chunks, ..."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n_chunks * length - x.shape[1])
    x = jnp.pad(x, pad)
    x = x.reshape(x.shape[0], length, n_chunks, *x.shape[2:])
    return jnp.moveaxis(x, 2, 0)


def _unchunk(x: jax.Array, seq: int) -> jax.Array:
    """Inverse of :func:`_strided_chunks`."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :seq]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _cross_entropy(h, weight, bias, targets, limit, vocab_axis, chunk, shard_vocab, distribution, tiled):
    return _forward(h, weight, bias, targets, limit, vocab_axis, chunk, shard_vocab, distribution, tiled)[0]


def _sampled(logits, targets, limit, distribution):
    """``logits`` (float32) as the distribution's: scaled by 1/temperature, -inf where the filters
    or the vocabulary limit drop a token, the target kept; ``logits`` itself for the model's own."""
    if distribution == MODEL_DISTRIBUTION and limit is None:
        return logits
    temperature, top_k, top_p = distribution
    scaled = logits / temperature if temperature != 1 else logits
    is_target = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
    return jnp.where(is_target, scaled, processed_logits(scaled, 1.0, top_k, top_p, limit))


def _no_constraint(x: jax.Array, axis: int) -> jax.Array:
    return x


def _layout(seq: int, chunk: int) -> tuple[int, int]:
    n_chunks = -(-seq // chunk)
    return n_chunks, -(-seq // n_chunks)


def _forward(h, weight, bias, targets, limit, vocab_axis, chunk, shard_vocab, distribution, tiled):
    seq = h.shape[1]
    n_chunks, length = _layout(seq, chunk)
    weight_c = shard_vocab(weight.astype(h.dtype), vocab_axis)  # the matmul runs in the compute dtype

    def one_chunk(_, inputs):
        h_c, t_c, limit_c = inputs
        logits = _sampled(head_logits(h_c, weight_c, bias, vocab_axis), t_c, limit_c, distribution)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
        return None, (log_z - target, log_z)

    chunks = functools.partial(_strided_chunks, n_chunks=n_chunks, length=length)
    inputs = (chunks(h), chunks(targets), None if limit is None else chunks(limit))
    _, (ce, log_z) = jax.lax.scan(one_chunk, None, inputs)
    ce, log_z = _unchunk(ce, seq), _unchunk(log_z, seq)
    return (ce, log_z), (h, weight, bias, targets, limit, log_z)


def _backward(vocab_axis, chunk, shard_vocab, distribution, tiled, residuals, cotangents):
    h, weight = residuals[:2]
    n_chunks, _ = _layout(h.shape[1], chunk)
    tiles = vocab_tiles(weight.shape[vocab_axis], n_chunks) if tiled else None
    if tiles is not None and distribution[1:] == MODEL_DISTRIBUTION[1:]:  # no filter needs a whole row
        return _tiled_backward(vocab_axis, tiles, shard_vocab, distribution[0], residuals, cotangents)
    return _chunked_backward(vocab_axis, chunk, shard_vocab, distribution, residuals, cotangents)


TILES_PER_CHUNK = 4
"""Vocabulary tiles per position chunk that :func:`vocab_tiles` aims for: a tile's logits at every
position are a quarter of a chunk's (tiles are recomputed, transposed and differentiated at once)."""


def vocab_tiles(vocab: int, n_chunks: int) -> int | None:
    """How many tiles the backward pass splits the vocabulary into: a divisor of ``vocab`` between
    ``n_chunks`` and 16 x ``n_chunks``, the smallest from ``TILES_PER_CHUNK`` x ``n_chunks`` on, else
    the largest below it; None when there is none or one chunk holds the sequence (the backward
    pass then walks position chunks: a byte vocabulary's one chunk planned 0.7% less than one tile)."""
    if n_chunks == 1:  # one chunk holds the sequence: its product is the head's whole gradient
        return None
    divisors = [t for t in range(n_chunks, 16 * n_chunks + 1) if vocab % t == 0]
    above = [t for t in divisors if t >= TILES_PER_CHUNK * n_chunks]
    return above[0] if above else divisors[-1] if divisors else None


def _tiled_backward(vocab_axis, tiles, shard_vocab, temperature, residuals, cotangents):
    """The backward pass over vocabulary tiles instead of position chunks: each step recomputes one
    tile's logits at every position, adds its share of the hidden-state gradient to a (batch, seq,
    embed) float32 accumulator and writes its rows of the head's gradient in place. A position
    chunk's share of the head's gradient is a (vocab, embed) product added to the accumulator, one
    more head-sized buffer (134 MB at 262,144 x 128); a tile's is (vocab / tiles, embed).

    Tile j holds the ids j, j + tiles, j + 2 x tiles, ...: a vocabulary split over devices in
    contiguous blocks (``vocab_parallel``) gives every device an equal part of each tile."""
    h, weight, bias, targets, limit, log_z = residuals
    g_ce, g_lse = cotangents
    vocab, embed = weight.shape[vocab_axis], weight.shape[1 - vocab_axis]
    per_tile = vocab // tiles
    # (vocab, embed) -> (vocab / tiles, tiles, embed), or (embed, vocab) -> (embed, vocab / tiles, tiles)
    stacked = (per_tile, tiles, embed) if vocab_axis == 0 else (embed, per_tile, tiles)
    tile_axis = 1 if vocab_axis == 0 else 2
    weight_t = shard_vocab(weight.astype(h.dtype).reshape(stacked), vocab_axis)
    bias_t = None if bias is None else bias.reshape(per_tile, tiles)
    limit_b = None if limit is None else limit[..., None]
    g_sum = (g_ce + g_lse)[..., None]

    def one_tile(carry, j):
        d_h, d_weight, d_bias = carry
        w_j = shard_vocab(jax.lax.dynamic_index_in_dim(weight_t, j, tile_axis, keepdims=False), vocab_axis)
        b_j = None if bias_t is None else jax.lax.dynamic_index_in_dim(bias_t, j, 1, keepdims=False)
        logits = head_logits(h, w_j, b_j, vocab_axis)
        if temperature != 1:
            logits = logits / temperature
        ids = jnp.arange(per_tile, dtype=targets.dtype) * tiles + j
        is_target = ids == targets[..., None]
        if limit_b is not None:  # ids the sampler could not draw (the target always kept)
            logits = jnp.where((ids < limit_b) | is_target, logits, -jnp.inf)
        d_logits = jnp.exp(logits - log_z[..., None]) * g_sum - jnp.where(is_target, g_ce[..., None], 0.0)
        if temperature != 1:  # through logits / temperature
            d_logits = d_logits / temperature
        d_logits_c = d_logits.astype(h.dtype)
        spec_h = "btv,ve->bte" if vocab_axis == 0 else "btv,ev->bte"
        d_h = d_h + jnp.einsum(spec_h, d_logits_c, w_j, preferred_element_type=jnp.float32)
        spec_w = "btv,bte->ve" if vocab_axis == 0 else "bte,btv->ev"
        operands = (d_logits_c, h) if vocab_axis == 0 else (h, d_logits_c)
        d_w_j = jnp.einsum(spec_w, *operands, preferred_element_type=jnp.float32)
        d_weight = jax.lax.dynamic_update_index_in_dim(d_weight, d_w_j, j, tile_axis)
        if d_bias is not None:
            d_bias = jax.lax.dynamic_update_index_in_dim(d_bias, jnp.sum(d_logits, axis=(0, 1)), j, 1)
        return (d_h, d_weight, d_bias), None

    carry = (
        jnp.zeros(h.shape, jnp.float32),
        shard_vocab(jnp.zeros(stacked, jnp.float32), vocab_axis),
        None if bias is None else jnp.zeros((per_tile, tiles), jnp.float32),
    )
    (d_h, d_weight, d_bias), _ = jax.lax.scan(one_tile, carry, jnp.arange(tiles, dtype=jnp.int32))
    return (
        d_h.astype(h.dtype),
        d_weight.reshape(weight.shape).astype(weight.dtype),
        None if bias is None else d_bias.reshape(bias.shape).astype(bias.dtype),
        None,
        None,
    )


def _chunked_backward(vocab_axis, chunk, shard_vocab, distribution, residuals, cotangents):
    h, weight, bias, targets, limit, log_z = residuals
    g_ce, g_lse = cotangents
    seq = h.shape[1]
    n_chunks, length = _layout(seq, chunk)
    vocab = weight.shape[vocab_axis]
    weight_c = shard_vocab(weight.astype(h.dtype), vocab_axis)
    temperature = distribution[0]

    def one_chunk(carry, inputs):
        d_weight, d_bias = carry
        h_c, t_c, limit_c, lse_c, g_ce_c, g_lse_c = inputs
        logits = _sampled(head_logits(h_c, weight_c, bias, vocab_axis), t_c, limit_c, distribution)
        probs = jnp.exp(logits - lse_c[..., None])
        is_target = jnp.arange(vocab, dtype=t_c.dtype) == t_c[..., None]
        d_logits = probs * (g_ce_c + g_lse_c)[..., None] - jnp.where(is_target, g_ce_c[..., None], 0.0)
        if temperature != 1:  # through logits / temperature
            d_logits = d_logits / temperature
        d_logits_c = d_logits.astype(h.dtype)
        spec_h = "btv,ve->bte" if vocab_axis == 0 else "btv,ev->bte"
        d_h = jnp.einsum(spec_h, d_logits_c, weight_c, preferred_element_type=jnp.float32)
        # accumulated as (embed, vocab) whatever the weight's layout: h^T @ d_logits reads both
        # operands as stored (no transposed copy of the chunk's logits), one transpose at the end
        d_weight = d_weight + jnp.einsum("bte,btv->ev", h_c, d_logits_c, preferred_element_type=jnp.float32)
        if d_bias is not None:
            d_bias = d_bias + jnp.sum(d_logits, axis=(0, 1))
        return (d_weight, d_bias), d_h.astype(h.dtype)

    chunks = functools.partial(_strided_chunks, n_chunks=n_chunks, length=length)
    limits = None if limit is None else chunks(limit)
    inputs = (chunks(h), chunks(targets), limits, chunks(log_z), chunks(g_ce), chunks(g_lse))
    embed = weight.shape[1 - vocab_axis]
    carry = (
        shard_vocab(jnp.zeros((embed, vocab), jnp.float32), 1),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    )
    (d_weight, d_bias), d_h = jax.lax.scan(one_chunk, carry, inputs)
    if vocab_axis == 0:
        d_weight = d_weight.T
    return (
        _unchunk(d_h, seq),
        d_weight.astype(weight.dtype),
        None if bias is None else d_bias.astype(bias.dtype),
        None,
        None,
    )


_cross_entropy.defvjp(_forward, _backward)


def chunked_cross_entropy(
    h: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    *,
    bias: jax.Array | None = None,
    vocab_axis: int = 0,
    chunk: int = 0,
    shard_vocab: Callable[[jax.Array, int], jax.Array] | None = None,
    distribution: tuple[float, int, float] = MODEL_DISTRIBUTION,
    vocab_limit: jax.Array | None = None,
    vocab_tiling: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy and log-partition of the logits ``h @ weight (+ bias)``.

    h: (batch, seq, embed) final hidden states (the matmul runs in h's dtype, accumulating in
    float32); weight: the LM head, (vocab, embed) with ``vocab_axis=0`` (the tied embedding) or
    (embed, vocab) with ``vocab_axis=1``; bias: (vocab,) or None; targets: (batch, seq) int.
    ``chunk``: sequence positions per chunk (0: :func:`auto_chunk`). ``shard_vocab(x, axis)``
    (optional, a hashable function) constrains the layout of the head's weight, its gradient and
    so each chunk's logits along their vocabulary ``axis`` (vocabulary parallelism on a mesh; the
    step passes one built from the logical-axis rules). ``distribution``: (temperature, top_k,
    top_p) of a sampler, and ``vocab_limit`` (batch, seq) int: the ids it could draw (below the
    limit); then ``ce`` is each target's negative log-probability under that distribution and
    ``log_z`` its log-partition. ``vocab_tiling``: the backward pass walks tiles of the vocabulary
    (:func:`vocab_tiles`); False: position chunks (the step passes False on a mesh, where a split
    vocabulary would reduce each tile's hidden-state gradient over devices, tile after tile). Returns (ce,
    log_z), both (batch, seq) float32, equal to ``zaya_jax.loss.token_losses`` of the full
    (processed) logits in value and gradient.
    """
    if vocab_axis not in (0, 1):
        raise ValueError(f"vocab_axis must be 0 or 1, got {vocab_axis}")
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0 (0: automatic), got {chunk}")
    chunk = chunk or auto_chunk(weight.shape[vocab_axis])
    chunk = min(chunk, h.shape[1])
    temperature, top_k, top_p = distribution
    if not (temperature > 0 and top_k >= 0 and top_p > 0):
        raise ValueError(
            f"distribution (temperature, top_k, top_p) = {distribution} is not one a sampler draws from"
        )
    distribution = (float(temperature), int(top_k), float(top_p))
    limit = None if vocab_limit is None else vocab_limit.astype(jnp.int32)
    return _cross_entropy(
        h,
        weight,
        bias,
        targets.astype(jnp.int32),
        limit,
        vocab_axis,
        chunk,
        shard_vocab or _no_constraint,
        distribution,
        vocab_tiling,
    )
