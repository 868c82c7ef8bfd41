"""The fused Pallas attention kernel (``model.attention_impl: pallas``) equals the dense definition
in values and gradients, run in Pallas interpret mode on CPU: every mask kind (causal, documents,
padding, window, all), GQA groupings without repeated K/V, lengths off the block size, queries at
other slots than the keys (prefill), fully padded rows, the log-sum-exp and its gradient (the
ring's merge), bfloat16; and it walks only the key blocks that can hold a visible key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.attention_cases import RTOL, _inputs, _mask, _max_rel_error, prefill_case
from zaya_jax.ops.attention import attention, dot_product_attention, self_attention_mask
from zaya_jax.ops.attention.pallas import _key_block_range, pallas_attention


def _compare(q, k, v, w, mask, block=16):
    def dense(q, k, v):
        return dot_product_attention(q, k, v, mask.dense())

    def fused(q, k, v):
        return pallas_attention(q, k, v, mask, block_q=block, block_k=block)[0].reshape(*q.shape[:2], -1)

    def grads(fn):
        return jax.grad(lambda q, k, v: jnp.sum(w * fn(q, k, v)), argnums=(0, 1, 2))(q, k, v)

    got = fused(q, k, v)
    assert _max_rel_error(got, dense(q, k, v)) <= RTOL
    for name, a, b in zip("qkv", grads(fused), grads(dense), strict=True):
        assert _max_rel_error(a, b) <= RTOL, name
    return got


@pytest.mark.parametrize("kind", ["causal", "documents", "padding", "window", "all"])
def test_every_mask_kind_equals_the_definition(kind):
    q, k, v, w = _inputs(2, 37, 4, 2)  # 37: off the 16-slot blocks
    _compare(q, k, v, w, _mask(kind, 2, 37))


@pytest.mark.parametrize(("nq", "nk"), [(4, 4), (4, 1)])
def test_gqa_groupings_read_their_kv_head_without_repeating_it(nq, nk):
    q, k, v, w = _inputs(2, 40, nq, nk)
    _compare(q, k, v, w, _mask("all", 2, 40))


def test_queries_at_other_slots_than_the_keys_prefill():
    _compare(*prefill_case())


def test_fully_padded_rows_are_zero_with_a_log_sum_exp_of_minus_infinity():
    q, k, v, w = _inputs(2, 24, 4, 2)
    valid = np.ones((2, 24), bool)
    valid[1] = False
    valid[0, :6] = False
    mask = self_attention_mask(24, None, jnp.asarray(valid))
    out = _compare(q, k, v, w, mask)
    np.testing.assert_array_equal(np.asarray(out)[1], 0.0)
    np.testing.assert_array_equal(np.asarray(out)[0, :6], 0.0)
    assert np.isneginf(np.asarray(pallas_attention(q, k, v, mask)[1])[1]).all()


def test_log_sum_exp_and_its_gradient_equal_the_blocked_kernel():
    from zaya_jax.ops.attention import blocked_attention

    q, k, v, _ = _inputs(2, 30, 4, 2)
    mask = _mask("all", 2, 30)
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((2, 30, 4)), jnp.float32)

    def finite_lse(fn):
        def lse(q, k, v):
            value = fn(q, k, v)[1]
            return jnp.sum(weights * jnp.where(jnp.isfinite(value), value, 0.0))

        return lse

    ours = finite_lse(lambda q, k, v: pallas_attention(q, k, v, mask, block_q=16, block_k=16))
    blocked = finite_lse(lambda q, k, v: blocked_attention(q, k, v, mask, block=8))
    assert abs(float(ours(q, k, v)) - float(blocked(q, k, v))) <= RTOL * abs(float(blocked(q, k, v)))
    for a, b in zip(jax.grad(ours, (0, 1))(q, k, v), jax.grad(blocked, (0, 1))(q, k, v), strict=True):
        assert _max_rel_error(a, b) <= RTOL


def test_bfloat16_inputs_follow_the_float32_definition_through_attention():
    q, k, v, _ = _inputs(2, 64, 4, 2)
    mask = _mask("documents", 2, 64)
    want = dot_product_attention(q, k, v, mask.dense())
    got = attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask, impl="pallas", block=16)
    assert got.dtype == jnp.bfloat16
    assert _max_rel_error(got.astype(jnp.float32), want) < 2e-2


def test_only_key_blocks_that_can_hold_a_visible_key_are_walked():
    """Aligned 64 slots in 16-slot blocks: query block i walks key blocks 0..i (causal), and with
    a 5-slot window only the blocks its window reaches; unaligned masks walk every block."""
    slots = jnp.arange(64, dtype=jnp.int32)
    for i in range(4):
        q_slot = slots[16 * i : 16 * (i + 1)]
        assert tuple(map(int, _key_block_range(q_slot, q_slot - 10**9, 16, 4, True))) == (0, i + 1)
        assert tuple(map(int, _key_block_range(q_slot, q_slot - 4, 16, 4, True))) == (
            max(0, i - 1) if i else 0,
            i + 1,
        )
    assert _key_block_range(slots[:16], slots[:16], 16, 4, False) == (0, 4)
    padded = jnp.full((16,), -1, jnp.int32)  # a block of padding queries walks nothing
    lo, hi = _key_block_range(padded, jnp.full((16,), 2**30, jnp.int32), 16, 4, True)
    assert int(hi) - int(lo) == 0


def test_the_library_kernel_takes_causal_masks_and_refuses_what_it_cannot_express():
    """``attention_impl: cudnn`` (``jax.nn.dot_product_attention``; XLA's kernel on CPU) equals the
    definition on plain causal self-attention and names what it cannot express otherwise."""
    q, k, v, _ = _inputs(2, 40, 4, 2)
    mask = self_attention_mask(40)
    want = dot_product_attention(q, k, v, mask.dense())
    assert _max_rel_error(attention(q, k, v, mask, impl="cudnn"), want) <= RTOL
    with pytest.raises(ValueError, match=r"document ids.*use attention_impl pallas or blocked"):
        attention(q, k, v, _mask("documents", 2, 40), impl="cudnn")
    with pytest.raises(ValueError, match="a sliding window"):
        attention(q, k, v, _mask("window", 2, 40), impl="cudnn")


def test_a_model_trains_with_the_pallas_kernel_to_the_blocked_kernels_loss():
    """One forward and backward of the tiny model with attention_impl pallas (interpret mode) equals
    blocked, documents packed."""
    import dataclasses

    from tests.random_model import random_variables, tiny_config
    from zaya_jax.model import Zaya

    cfg = tiny_config(attention_block=16)
    variables = random_variables(cfg)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 40)), jnp.int32)
    segments = jnp.asarray([[1] * 17 + [2] * 23], jnp.int32)

    def loss(impl):
        model = Zaya(dataclasses.replace(cfg, attention_impl=impl))

        def f(params):
            logits, _ = model.apply({**variables, "params": params}, ids, segment_ids=segments)
            return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

        return jax.value_and_grad(f)(variables["params"])

    (blocked, g_blocked), (fused, g_fused) = loss("blocked"), loss("pallas")
    assert abs(float(fused) - float(blocked)) <= 1e-5 * abs(float(blocked))
    for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_blocked), strict=True):
        assert _max_rel_error(a, b) <= 1e-4


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_the_kernels_lower_to_triton_for_both_gpu_platforms(platform):
    """No GPU here, but Pallas lowers to Triton IR without one: forward, dq and dk/dv kernels at
    ZAYA1's head shape (8 query / 2 KV heads of 64, bf16, every mask kind) pass Pallas's Triton
    lowering for CUDA and ROCm, so an op Triton cannot take fails here rather than on the cluster.
    (Triton's own compilation to PTX / AMDGPU runs on the device.)"""
    q, k, v, _ = _inputs(2, 256, 8, 2, d=64)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    mask = _mask("all", 2, 256)

    def loss(q, k, v):
        out = pallas_attention(q, k, v, mask, block_q=64, block_k=64, interpret=False)[0]
        return out.astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    for name in ("zaya_attention_forward", "zaya_attention_dq", "zaya_attention_dkv"):
        assert name in text, name
