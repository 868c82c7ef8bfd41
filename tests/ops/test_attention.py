"""The blocked (flash-style) attention equals the dense definition in values and gradients for every
mask kind, GQA grouping and length; it never computes blocks above the diagonal, and its memory
grows linearly with the sequence where the dense one grows quadratically."""

from __future__ import annotations

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.attention_cases import RTOL, _inputs, _mask, _max_rel_error, prefill_case
from zaya_jax.ops.attention import (
    AttentionMask,
    attention,
    blocked_attention,
    dot_product_attention,
    self_attention_mask,
)


def _compare(q, k, v, w, mask, block):
    def loss(fn):
        return lambda q, k, v: jnp.sum(w * fn(q, k, v))

    def dense(q, k, v):
        return dot_product_attention(q, k, v, mask.dense())

    def blocked(q, k, v):  # the kernel itself, also where attention() would take the dense path
        return blocked_attention(q, k, v, mask, block=block)[0].reshape(*q.shape[:2], -1)

    want, got = dense(q, k, v), jax.jit(blocked)(q, k, v)
    g_want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2)))(q, k, v)
    assert _max_rel_error(got, want) <= RTOL
    for name, a, b in zip("qkv", g_got, g_want, strict=True):
        assert _max_rel_error(a, b) <= RTOL, name
    return got


@pytest.mark.parametrize("kind", ["causal", "documents", "padding", "window", "all"])
@pytest.mark.parametrize(("nq", "nk"), [(4, 4), (4, 2), (4, 1)])
def test_blocked_equals_dense_for_every_mask_and_grouping(kind, nq, nk):
    q, k, v, w = _inputs(2, 37, nq, nk)  # 37: not a multiple of the 8-slot blocks
    _compare(q, k, v, w, _mask(kind, 2, 37), block=8)


@pytest.mark.parametrize(("seq", "block"), [(7, 8), (64, 8), (65, 8), (100, 16), (128, 128)])
def test_lengths_that_are_not_multiples_of_the_block(seq, block):
    q, k, v, w = _inputs(2, seq, 4, 2)
    _compare(q, k, v, w, _mask("all", 2, seq), block)


def test_fully_padded_rows_are_zero_in_both_and_pass_no_gradient():
    q, k, v, w = _inputs(2, 24, 4, 2)
    valid = np.ones((2, 24), bool)
    valid[1] = False  # a row of nothing but padding
    valid[0, :6] = False  # left padding: the first 6 queries of row 0 see no key
    mask = self_attention_mask(24, None, jnp.asarray(valid))
    out = _compare(q, k, v, w, mask, block=8)
    np.testing.assert_array_equal(np.asarray(out)[1], 0.0)
    np.testing.assert_array_equal(np.asarray(out)[0, :6], 0.0)
    _, lse = blocked_attention(q, k, v, mask, block=8)
    assert np.isneginf(np.asarray(lse)[1]).all()


def test_a_sliding_window_of_one_slot_attends_to_itself_only():
    q, k, v, _ = _inputs(1, 20, 2, 2)
    mask = self_attention_mask(20).replace(window=jnp.int32(1))
    out = attention(q, k, v, mask, block=4)
    np.testing.assert_allclose(np.asarray(out).reshape(1, 20, 2, 8), np.asarray(v), rtol=1e-6, atol=1e-6)


def test_queries_at_other_slots_than_the_keys_decode_and_prefill():
    _compare(*prefill_case(), block=8)


def test_log_sum_exp_and_its_gradient_are_exact():
    """The second output, used to merge ring hops, is the log-sum-exp of each row's visible scores,
    with a gradient of its own."""
    q, k, v, _ = _inputs(2, 30, 4, 2)
    mask = _mask("all", 2, 30)
    d = q.shape[-1]

    def dense_lse(q, k):
        scores = jnp.einsum("btkgd,bskd->bkgts", q.reshape(2, 30, 2, 2, d), k) * d**-0.5
        visible = mask.dense()[:, None, None]
        lse = jax.nn.logsumexp(jnp.where(visible, scores, -jnp.inf), axis=-1)
        return jnp.where(jnp.isfinite(lse), lse, 0.0).transpose(0, 3, 1, 2).reshape(2, 30, 4)

    def blocked_lse(q, k):
        lse = blocked_attention(q, k, v, mask, block=8)[1]
        return jnp.where(jnp.isfinite(lse), lse, 0.0)

    assert _max_rel_error(blocked_lse(q, k), dense_lse(q, k)) <= RTOL
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((2, 30, 4)), jnp.float32)
    for a, b in zip(
        jax.grad(lambda q, k: jnp.sum(weights * blocked_lse(q, k)), argnums=(0, 1))(q, k),
        jax.grad(lambda q, k: jnp.sum(weights * dense_lse(q, k)), argnums=(0, 1))(q, k),
        strict=True,
    ):
        assert _max_rel_error(a, b) <= RTOL


def test_bfloat16_inputs_follow_the_float32_definition():
    q, k, v, _ = _inputs(2, 64, 4, 2)
    mask = _mask("documents", 2, 64)
    want = dot_product_attention(q, k, v, mask.dense())
    got = attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask, block=16)
    assert got.dtype == jnp.bfloat16
    assert _max_rel_error(got.astype(jnp.float32), want) < 2e-2


def _matmul_flops(jaxpr) -> int:
    """Multiply-adds of every dot_general in a jaxpr, loops counted by their trip counts."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += math.prod(out) * math.prod(lhs[i] for i in lhs_contract)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _matmul_flops(sub) * eqn.params.get("length", 1)
    return total


def test_blocks_above_the_diagonal_are_never_computed():
    """A sequence attending to itself in 16 blocks computes the 136 blocks on or below the
    diagonal: (n + 1) / 2n of the work of comparing every query with every key block, as the
    non-aligned path does with the same slots."""
    seq, block = 256, 16
    q, k, v, _ = _inputs(1, seq, 4, 2)
    aligned = self_attention_mask(seq)
    everything = AttentionMask(aligned.q_slots, aligned.k_slots)  # same slots, aligned=False

    def flops(mask):
        return _matmul_flops(
            jax.make_jaxpr(lambda q, k, v: attention(q, k, v, mask, block=block))(q, k, v).jaxpr
        )

    n = seq // block
    assert flops(aligned) / flops(everything) == pytest.approx((n + 1) / (2 * n), rel=1e-6)
    np.testing.assert_allclose(
        attention(q, k, v, aligned, block=block),
        attention(q, k, v, everything, block=block),
        rtol=0,
        atol=1e-5,
    )


def _gradient_temp_bytes(seq: int, impl: str, block: int = 128) -> int:
    q = jax.ShapeDtypeStruct((1, seq, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 32), jnp.float32)
    segments = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def loss(q, k, v, segments):
        return jnp.sum(attention(q, k, v, self_attention_mask(seq, segments), impl=impl, block=block))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, segments).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def test_attention_memory_grows_linearly_with_the_sequence():
    """Forward + backward temporaries as XLA plans them: doubling the sequence at most ~doubles the
    blocked kernel's (measured 2.1x), quadruples the dense one's (the (s, s) scores and mask)."""
    blocked = {seq: _gradient_temp_bytes(seq, "blocked") for seq in (1024, 2048, 4096)}
    dense = {seq: _gradient_temp_bytes(seq, "dense") for seq in (1024, 2048)}
    assert blocked[4096] / blocked[2048] <= 2.3
    assert blocked[2048] / blocked[1024] <= 2.3
    assert dense[2048] / dense[1024] >= 3.5
    assert blocked[2048] < dense[2048] / 4
    # No (s, s) float32 array can fit: a 4096 x 4096 score matrix alone is 64 MiB per head.
    assert blocked[4096] < 4096 * 4096 * 4 * 2


def test_a_sequence_within_one_block_takes_the_dense_path_with_the_same_result():
    q, k, v, _ = _inputs(2, 24, 4, 2)
    mask = _mask("all", 2, 24)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, mask, block=32))(q, k, v))
    assert "custom_vjp" not in jaxpr  # no recomputing kernel for a single block
    np.testing.assert_allclose(
        attention(q, k, v, mask, block=32),
        blocked_attention(q, k, v, mask, block=32)[0].reshape(2, 24, -1),
        rtol=1e-5,
        atol=1e-6,
    )


def test_an_aligned_mask_needs_as_many_queries_as_keys():
    q, k, v, _ = _inputs(1, 8, 2, 2, seq_k=12)
    with pytest.raises(ValueError, match="as many queries as keys"):
        blocked_attention(q, k, v, self_attention_mask(8))


@pytest.mark.parametrize("seq", [1, 2, 5], ids=["decode", "two", "chunk"])
def test_per_row_query_slots_see_their_own_causal_window_and_keys(seq):
    """A slot cache's mask (q_slots per row) is each row's own causal, windowed, valid-key mask, and
    attention over it (products and sums for a few queries, matmuls for more) equals the definition."""
    batch, slots = 3, 12
    q, k, v, _ = _inputs(batch, seq, 4, 2, seq_k=slots, seed=seq)
    index = jnp.asarray([0, 4, 7])
    valid = jnp.arange(slots)[None] < (index + seq)[:, None]
    mask = AttentionMask(
        q_slots=index[:, None] + jnp.arange(seq),
        k_slots=jnp.arange(slots),
        k_valid=valid,
        window=jnp.int32(4),
    )
    assert mask.per_row
    dense = np.asarray(mask.dense())
    for row in range(batch):
        for t in range(seq):
            position = int(index[row]) + t
            expected = [position - 4 < key <= position for key in range(slots)]
            assert dense[row, t].tolist() == expected
    got = attention(q, k, v, mask, impl="blocked")
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(dot_product_attention(q, k, v, mask.dense())), atol=1e-5
    )
