"""The fused CPU attention custom call (``model.attention_impl: cpu``) equals the JAX blocked kernel
(and the dense definition) in values and gradients: every mask kind, lengths off and across its
64-slot blocks, GQA groupings without repeated K/V, queries at other slots than the keys (prefill),
fully padded rows, the log-sum-exp and its gradient (the ring's merge), bfloat16, and a model's
loss and gradients. The custom call is in the compiled program (no silent fallback)."""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.attention_cases import RTOL, _inputs, _mask, _max_rel_error, prefill_case
from zaya_jax.ops.attention import attention, blocked_attention, dot_product_attention, self_attention_mask
from zaya_jax.ops.attention.cpu import FORWARD, available, cpu_attention


def test_the_custom_call_is_built_and_in_the_program():
    assert available(), "the CPU library lacks zaya_attention_*: rebuild with python custom_calls/build.py"
    q, k, v, w = _inputs(1, 70, 4, 2)
    mask = self_attention_mask(70)
    loss = lambda q: jnp.sum(w * attention(q, k, v, mask, impl="cpu", block=32))  # noqa: E731
    text = jax.jit(jax.grad(loss)).lower(q).as_text()
    assert FORWARD in text and "zaya_attention_bwd" in text


@pytest.mark.parametrize(("seq", "fused"), [(64, False), (65, True), (128, True)])
def test_one_kernel_block_runs_the_dense_definition_two_run_the_kernel(seq, fused):
    """Within one of the kernel's 64-key blocks the dense definition is as fast (dispatch.py's
    measurements); from two on, the custom call runs, also for the default one-block ``block``."""
    q, k, v, w = _inputs(2, seq, 4, 2)
    loss = lambda q: jnp.sum(w * attention(q, k, v, self_attention_mask(seq), impl="cpu", block=128))  # noqa: E731
    text = jax.jit(jax.grad(loss)).lower(q).as_text()
    assert (FORWARD in text) is fused and ("zaya_attention_bwd" in text) is fused


# (batch, seq): few (batch, KV head) pairs, one work item per key block and dQ summed over lanes;
# many pairs (>= 4 per worker on up to 15 threads), one item per pair owning its dQ.
SPLITS = [(4, 600), (32, 130)]


@pytest.mark.parametrize(("batch", "seq"), SPLITS)
def test_the_backward_gives_the_same_bits_on_every_call(batch, seq):
    """dQ's partial sums have a fixed partition over the threads' work, so repeated gradients agree
    bit for bit, also while other work keeps XLA's threads busy (a resumed run repeats the
    uninterrupted one)."""
    q, k, v, w = _inputs(batch, seq, 4, 2)
    mask = self_attention_mask(seq)
    grad = jax.jit(jax.grad(lambda q: jnp.sum(w * attention(q, k, v, mask, impl="cpu")), argnums=0))
    first = np.asarray(grad(q))
    other = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    a = jnp.ones((768, 768), jnp.float32) / 768
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            jax.block_until_ready(other(a))

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        for _ in range(12):
            np.testing.assert_array_equal(np.asarray(grad(q)), first)
    finally:
        stop.set()
        thread.join()


def _compare(q, k, v, w, mask):
    def fused(q, k, v):
        return cpu_attention(q, k, v, mask)[0].reshape(*q.shape[:2], -1)

    def blocked(q, k, v):
        return blocked_attention(q, k, v, mask, block=16)[0].reshape(*q.shape[:2], -1)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(w * fn(q, k, v)), argnums=(0, 1, 2)))(q, k, v)

    got = jax.jit(fused)(q, k, v)
    assert _max_rel_error(got, blocked(q, k, v)) <= RTOL
    assert _max_rel_error(got, dot_product_attention(q, k, v, mask.dense())) <= RTOL
    for name, a, b in zip("qkv", grads(fused), grads(blocked), strict=True):
        assert _max_rel_error(a, b) <= RTOL, name
    return got


@pytest.mark.parametrize("seq", [37, 150])  # inside one 64-slot block; across three, the last partial
@pytest.mark.parametrize("kind", ["causal", "documents", "padding", "window", "all"])
def test_every_mask_kind_equals_the_blocked_kernel(kind, seq):
    q, k, v, w = _inputs(2, seq, 4, 2, d=16)
    _compare(q, k, v, w, _mask(kind, 2, seq))


@pytest.mark.parametrize(("batch", "seq"), SPLITS)
def test_both_splits_of_the_backward_equal_the_blocked_kernel(batch, seq):
    q, k, v, w = _inputs(batch, seq, 4, 2, d=16)
    _compare(q, k, v, w, _mask("all", batch, seq))


@pytest.mark.parametrize(("nq", "nk", "d"), [(4, 4, 32), (4, 1, 8), (6, 2, 24)])
def test_gqa_groupings_and_head_widths(nq, nk, d):
    q, k, v, w = _inputs(2, 90, nq, nk, d=d)
    _compare(q, k, v, w, _mask("all", 2, 90))


def test_queries_at_other_slots_than_the_keys_prefill():
    _compare(*prefill_case())


def test_fully_padded_rows_are_zero_with_a_log_sum_exp_of_minus_infinity():
    q, k, v, w = _inputs(2, 80, 4, 2)
    valid = np.ones((2, 80), bool)
    valid[1] = False
    valid[0, :70] = False  # the first query block sees nothing, the second some keys
    mask = self_attention_mask(80, None, jnp.asarray(valid))
    out = np.asarray(_compare(q, k, v, w, mask))
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(out[0, :70], 0.0)
    lse = np.asarray(cpu_attention(q, k, v, mask)[1])
    assert np.isneginf(lse[1]).all() and np.isneginf(lse[0, :70]).all() and np.isfinite(lse[0, 70:]).all()


def test_log_sum_exp_and_its_gradient_equal_the_blocked_kernel():
    q, k, v, _ = _inputs(2, 100, 4, 2)
    mask = _mask("all", 2, 100)
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((2, 100, 4)), jnp.float32)

    def finite_lse(fn):
        def lse(q, k, v):
            out, value = fn(q, k, v)
            return jnp.sum(weights * jnp.where(jnp.isfinite(value), value, 0.0)) + 0.1 * jnp.sum(out)

        return lse

    ours = finite_lse(lambda q, k, v: cpu_attention(q, k, v, mask))
    blocked = finite_lse(lambda q, k, v: blocked_attention(q, k, v, mask, block=16))
    assert abs(float(ours(q, k, v)) - float(blocked(q, k, v))) <= RTOL * abs(float(blocked(q, k, v)))
    for a, b in zip(jax.grad(ours, (0, 1, 2))(q, k, v), jax.grad(blocked, (0, 1, 2))(q, k, v), strict=True):
        assert _max_rel_error(a, b) <= RTOL


def test_bfloat16_inputs_follow_the_float32_definition():
    q, k, v, _ = _inputs(2, 96, 4, 2, d=32)
    mask = _mask("documents", 2, 96)
    want = dot_product_attention(q, k, v, mask.dense())
    got = attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask, impl="cpu")
    assert got.dtype == jnp.bfloat16
    assert _max_rel_error(got.astype(jnp.float32), want) < 2e-2


def test_a_model_trains_with_the_cpu_kernel_to_the_blocked_kernels_loss():
    """One forward and backward of the tiny model with attention_impl cpu (the attention and CCA
    query/key custom calls) equals blocked (the JAX steps), documents packed, 150 tokens (three key
    blocks of the custom call, three of the CCA kernel's chunks, several of the blocked kernel)."""
    from tests.random_model import random_variables, tiny_config
    from zaya_jax.model import Zaya
    from zaya_jax.parallel import program_hooks

    cfg = tiny_config(attention_block=32)
    variables = random_variables(cfg)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 150)), jnp.int32)
    segments = jnp.asarray([[1] * 70 + [2] * 80, [1] * 150], jnp.int32)

    def loss(impl):
        model_cfg = dataclasses.replace(cfg, attention_impl=impl)
        model = Zaya(model_cfg, program_hooks(model_cfg))  # cpu: the kernel plan takes CCA's call too

        def f(params):
            logits, _ = model.apply({**variables, "params": params}, ids, segment_ids=segments)
            return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

        return jax.jit(jax.value_and_grad(f))(variables["params"])

    (blocked, g_blocked), (fused, g_fused) = loss("blocked"), loss("cpu")
    assert abs(float(fused) - float(blocked)) <= 1e-5 * abs(float(blocked))
    for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_blocked), strict=True):
        assert _max_rel_error(a, b) <= 1e-4


def test_auto_takes_the_custom_call_for_a_one_device_cpu_program_only():
    from zaya_jax.config import load_config
    from zaya_jax.ops.kernel_plan import resolve_kernel_plan
    from zaya_jax.ops.platform import planning_for

    cfg = load_config("tiny", [])
    assert cfg.model.attention_impl == "auto"
    assert resolve_kernel_plan(cfg.model, devices=1).attention == "cpu"
    assert resolve_kernel_plan(cfg.model, devices=2).attention == "blocked"  # XLA cannot split it
    with planning_for("gpu"):  # a GPU program planned on this CPU
        assert resolve_kernel_plan(cfg.model, devices=1).attention == "blocked"
    pinned = dataclasses.replace(cfg.model, attention_impl="blocked")
    assert resolve_kernel_plan(pinned, devices=1).attention == "blocked"


def test_the_handler_names_mismatched_mask_vectors():
    from zaya_jax.ops.attention.cpu import _ffi_forward

    q, k, v, _ = _inputs(1, 20, 4, 2)
    slots = jnp.arange(20, dtype=jnp.int32)
    rows = (
        slots,
        slots - 2**30,
        jnp.zeros((1, 20), jnp.int32),
        slots[:10],
        slots,
        jnp.zeros((1, 20), jnp.int32),
    )
    with pytest.raises(Exception, match=r"mask vectors must be q_slot"):
        jax.block_until_ready(jax.jit(lambda q, k, v: _ffi_forward(q, k, v, rows, 0.5))(q, k, v))
