"""The chunked cross-entropy equals the full-logits loss in value and gradient (tied and untied
heads, a bias, z-loss, chunks that do not divide the sequence), and its memory does not hold the
(tokens, vocab) logits."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.loss import token_losses
from zaya_jax.ops.cross_entropy import auto_chunk, chunked_cross_entropy, vocab_tiles
from zaya_jax.ops.sampling_filter import processed_logits


def _case(batch=2, seq=21, embed=16, vocab=50, seed=0, vocab_axis=0, bias=False):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((batch, seq, embed)), jnp.float32)
    shape = (vocab, embed) if vocab_axis == 0 else (embed, vocab)
    weight = jnp.asarray(rng.standard_normal(shape) / 4, jnp.float32)
    b = jnp.asarray(rng.standard_normal((vocab,)), jnp.float32) if bias else None
    targets = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)
    mask = jnp.asarray(rng.random((batch, seq)) > 0.2, jnp.float32)
    return h, weight, b, targets, mask


def _full(h, weight, bias, targets, vocab_axis):
    logits = h @ (weight.T if vocab_axis == 0 else weight)
    if bias is not None:
        logits = logits + bias
    return token_losses(logits, targets)


def _loss(fn, z_loss=1e-2):
    """A scalar that uses both outputs (the cross-entropy and the z-loss's log-partition)."""

    def loss(h, weight, bias, targets, mask):
        ce, log_z = fn(h, weight, bias, targets)
        return jnp.sum(ce * mask) + z_loss * jnp.sum(jnp.square(log_z) * mask)

    return loss


@pytest.mark.parametrize("chunk", [1, 4, 7, 21, 64])
@pytest.mark.parametrize(("vocab_axis", "bias"), [(0, False), (1, True)])
def test_chunked_loss_equals_full_logits_in_value_and_gradient(chunk, vocab_axis, bias):
    h, weight, b, targets, mask = _case(vocab_axis=vocab_axis, bias=bias)

    def chunked(h, weight, bias, targets):
        return chunked_cross_entropy(h, weight, targets, bias=bias, vocab_axis=vocab_axis, chunk=chunk)

    def full(h, weight, bias, targets):
        return _full(h, weight, bias, targets, vocab_axis)

    for got, want in zip(chunked(h, weight, b, targets), full(h, weight, b, targets), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    argnums = (0, 1, 2) if bias else (0, 1)
    grads = jax.jit(jax.grad(_loss(chunked), argnums=argnums))(h, weight, b, targets, mask)
    reference = jax.grad(_loss(full), argnums=argnums)(h, weight, b, targets, mask)
    for got, want in zip(grads, reference, strict=True):
        scale = float(np.max(np.abs(want)))
        assert float(np.max(np.abs(got - want))) <= 1e-5 * scale


def test_bfloat16_hidden_states_accumulate_in_float32():
    h, weight, _, targets, _ = _case(seq=32, vocab=40)
    ce, _ = chunked_cross_entropy(h.astype(jnp.bfloat16), weight, targets, chunk=8)
    want, _ = _full(h, weight, None, targets, 0)
    assert ce.dtype == jnp.float32
    np.testing.assert_allclose(ce, want, rtol=0.05, atol=0.05)
    d_h = jax.grad(lambda h: chunked_cross_entropy(h, weight, targets, chunk=8)[0].sum())(
        h.astype(jnp.bfloat16)
    )
    assert d_h.dtype == jnp.bfloat16


def test_automatic_chunk_keeps_one_rows_logits_near_the_budget():
    assert auto_chunk(262_144) == 64
    assert auto_chunk(262_272) == 48  # ZAYA1's vocabulary: 48 x 262,272 float32 = 50 MB per row
    assert auto_chunk(264) >= 32768  # the byte vocabulary: one chunk for any training row here
    assert auto_chunk(10**9) == 16


def _loss_temp_bytes(
    tokens: int, vocab: int, embed: int, chunk: int | None, vocab_tiling: bool = True
) -> int:
    h = jax.ShapeDtypeStruct((1, tokens, embed), jnp.float32)
    weight = jax.ShapeDtypeStruct((vocab, embed), jnp.float32)
    targets = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

    def loss(h, weight, targets):
        if chunk is None:
            ce, _ = _full(h, weight, None, targets, 0)
        else:
            ce, _ = chunked_cross_entropy(h, weight, targets, chunk=chunk, vocab_tiling=vocab_tiling)
        return ce.sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, weight, targets).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def test_vocabulary_tiles_divide_the_vocabulary_near_four_per_chunk():
    assert vocab_tiles(262_144, 64) == 256  # 4,096 positions in chunks of 64: 256 tiles of 1,024 ids
    assert vocab_tiles(262_272, 86) == 384  # ZAYA1's 2^7 x 3 x 683 ids: 683 per tile
    assert vocab_tiles(50_257, 13) == 29  # 29 x 1,733: fewer tiles than 4 per chunk, none above
    assert vocab_tiles(50, 1) is None  # one chunk holds the sequence: nothing to tile
    assert vocab_tiles(7_919, 3) is None  # a prime: position chunks in the backward pass


@pytest.mark.parametrize(("vocab_axis", "bias"), [(0, False), (1, True)])
def test_position_chunks_in_the_backward_pass_give_the_same_gradients(vocab_axis, bias):
    # vocab_tiling=False (a vocabulary split over devices) walks position chunks, as top-k does
    h, weight, b, targets, mask = _case(vocab_axis=vocab_axis, bias=bias)
    argnums = (0, 1, 2) if bias else (0, 1)
    grads = {}
    for tiling in (True, False):

        def chunked(h, weight, bias, targets, tiling=tiling):
            return chunked_cross_entropy(
                h, weight, targets, bias=bias, vocab_axis=vocab_axis, chunk=4, vocab_tiling=tiling
            )

        grads[tiling] = jax.jit(jax.grad(_loss(chunked), argnums=argnums))(h, weight, b, targets, mask)
    for got, want in zip(grads[False], grads[True], strict=True):
        assert float(np.max(np.abs(got - want))) <= 1e-5 * float(np.max(np.abs(want)))


@pytest.mark.parametrize(
    ("sizes", "tiled"), [((1, 1, 1, 1), True), ((2, 1, 1, 1), False), ((1, 4, 1, 1), False)]
)
def test_the_step_tiles_the_vocabulary_on_one_device_only(sizes, tiled):
    from zaya_jax.loss.forward import _vocab_tiling
    from zaya_jax.parallel import DEFAULT_RULES

    mesh = jax.sharding.AbstractMesh(sizes, ("data", "fsdp", "expert", "context"))
    assert _vocab_tiling()  # outside a step's mesh
    with nn.logical_axis_rules(DEFAULT_RULES), jax.sharding.use_abstract_mesh(mesh):
        assert _vocab_tiling() is tiled


def test_the_backward_pass_holds_no_head_sized_product():
    """Walking position chunks, each chunk's share of the head's gradient is a (vocab, embed)
    product added to the accumulator; walking vocabulary tiles, each tile writes its own rows. At a
    32k vocabulary and 4,096 tokens: measured 34.7 MB against 77.7 MB (the head is 8.4 MB, a
    chunk's logits 33.6 MB)."""
    tiled = _loss_temp_bytes(4096, 32768, 64, 256)
    chunked = _loss_temp_bytes(4096, 32768, 64, 256, vocab_tiling=False)
    assert tiled < chunked / 2


def test_loss_temporaries_shrink_with_the_chunk():
    """Forward + backward of the loss at a 32k vocabulary, 4,096 tokens: the full logits and their
    gradient (1 GiB planned) against 256-position chunks: at most 1/8 of it (measured 1/14: two
    chunk-sized buffers, a chunk's logits and their gradient, and the head's gradient)."""
    full = _loss_temp_bytes(4096, 32768, 64, None)
    chunked = _loss_temp_bytes(4096, 32768, 64, 256)
    logits = 4096 * 32768 * 4
    assert full >= logits
    assert chunked <= full / 8
    assert chunked < logits / 4


@pytest.mark.parametrize(
    "distribution",
    [(0.7, 0, 1.0), (1.0, 5, 1.0), (0.7, 0, 0.9), (1.3, 8, 0.8)],
    ids=lambda d: "-".join(map(str, d)),
)
def test_a_sampling_distribution_gives_the_processed_log_probabilities(distribution):
    """With (temperature, top_k, top_p) and a vocabulary limit, ``ce`` is -log p of each target under
    the distribution a sampler draws from (:func:`processed_logits`; the target kept), equal in
    value and gradient to the same computed on the full logits, the filter's choice held constant."""
    h, weight, b, _, mask = _case(vocab_axis=1, bias=True)
    temperature, top_k, top_p = distribution
    limit = jnp.full(mask.shape, 44, jnp.int32)  # ids 44..49: past the tokenizer's vocabulary
    logits = h @ weight + b
    processed = processed_logits(logits, temperature, top_k, top_p, limit)
    # targets the sampler could draw: each row's most likely token and others it kept
    rng = np.random.default_rng(3)
    allowed = np.isfinite(np.asarray(processed))
    targets = jnp.asarray([[rng.choice(np.flatnonzero(a)) for a in row] for row in allowed], jnp.int32)

    def chunked(h, weight, bias, targets):
        return chunked_cross_entropy(
            h, weight, targets, bias=bias, vocab_axis=1, chunk=4, distribution=distribution, vocab_limit=limit
        )

    def full(h, weight, bias, targets):
        logits = h @ weight + bias
        keep = jax.lax.stop_gradient(jnp.isfinite(processed_logits(logits, temperature, top_k, top_p, limit)))
        scaled = jnp.where(keep, logits / temperature, -jnp.inf)
        return token_losses(scaled, targets)

    ce, log_z = chunked(h, weight, b, targets)
    want_ce, want_log_z = full(h, weight, b, targets)
    np.testing.assert_allclose(ce, want_ce, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(log_z, want_log_z, rtol=1e-5, atol=1e-5)
    if distribution != (1.0, 5, 1.0):  # a temperature: not the model's own cross-entropy
        assert float(jnp.max(jnp.abs(ce - _full(h, weight, b, targets, 1)[0]))) > 1e-2
    grads = jax.jit(jax.grad(_loss(chunked), argnums=(0, 1, 2)))(h, weight, b, targets, mask)
    reference = jax.grad(_loss(full), argnums=(0, 1, 2))(h, weight, b, targets, mask)
    for got, want in zip(grads, reference, strict=True):
        assert float(np.max(np.abs(got - want))) <= 1e-5 * float(np.max(np.abs(want)))


def test_a_target_the_trainer_would_filter_still_counts():
    """A sampled token at the edge of top-p, which the trainer's float rounding could drop, is kept:
    its log-probability is finite, the kept set's log-partition over it too."""
    h, weight, b, targets, _ = _case(vocab_axis=1, bias=True)
    logits = h @ weight + b
    least = jnp.argmin(logits, axis=-1).astype(jnp.int32)  # outside any top-2
    ce, _ = chunked_cross_entropy(h, weight, least, bias=b, vocab_axis=1, distribution=(1.0, 2, 1.0))
    assert bool(jnp.all(jnp.isfinite(ce)))
    with pytest.raises(ValueError, match="not one a sampler draws from"):
        chunked_cross_entropy(h, weight, targets, bias=b, vocab_axis=1, distribution=(0.0, 0, 1.0))
