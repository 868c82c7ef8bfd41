"""Structural properties of the Flax model: logical axis names, depth-independent tracing, the
non-gradient balancing collection, mixed precision and the two MOD-skip semantics."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from tests.random_model import random_variables, tiny_config
from zaya_jax.model import BALANCING, Zaya, init_variables
from zaya_jax.model.layers import Dense

LOGICAL_AXES = {
    "vocab", "embed", "heads", "kv", "kv_heads", "qk", "qk_heads", "head_dim", "conv", "router",
    "router_mlp", "router_classes", "experts", "expert_mlp", "layers", None,
}  # fmt: skip


def test_every_variable_carries_logical_axis_names():
    cfg = tiny_config(attention_bias=True, tie_word_embeddings=False, lm_head_bias=True)
    boxed = jax.eval_shape(lambda: Zaya(cfg).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))
    leaves = jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )[0]
    assert len(leaves) > 30
    for path, leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned), jax.tree_util.keystr(path)
        assert len(leaf.names) == leaf.value.ndim, jax.tree_util.keystr(path)
        assert set(leaf.names) <= LOGICAL_AXES, (jax.tree_util.keystr(path), leaf.names)
    experts = boxed["params"]["layers"]["experts"]["wi"]
    assert experts.names == ("layers", "experts", "embed", "expert_mlp")


def test_traced_program_does_not_grow_with_depth():
    sizes = []
    for layers in (2, 9):
        cfg = tiny_config(num_layers=layers)
        variables = jax.eval_shape(lambda cfg=cfg: init_variables(cfg))
        jaxpr = jax.make_jaxpr(lambda v, t, cfg=cfg: Zaya(cfg).apply(v, t))(
            variables, jnp.ones((1, 5), jnp.int32)
        )
        sizes.append(len(jaxpr.eqns))
    assert sizes[0] == sizes[1]


def test_balancing_biases_are_a_separate_non_gradient_collection():
    cfg = tiny_config()
    variables = random_variables(cfg)
    assert set(variables) == {"params", BALANCING}
    assert variables[BALANCING]["layers"]["router"]["biases"].shape == (cfg.num_layers, cfg.num_experts + 1)
    tokens = jnp.asarray(np.arange(3, 19)[None])

    def loss(params, balancing):
        logits, _ = Zaya(cfg).apply({"params": params, BALANCING: balancing}, tokens)
        return jnp.mean(logits**2)

    _, g_balancing = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], variables[BALANCING])
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(g_balancing))

    # ... yet the biases steer selection: force everything into expert 2 in layer 0.
    forced = jax.tree.map(lambda b: b.at[0, 2].set(5.0), variables[BALANCING])
    _, aux = jax.jit(Zaya(cfg).apply)({"params": variables["params"], BALANCING: forced}, tokens)
    assert aux["load"][0, 2] == tokens.size


def test_router_intermediates_record_eda_states_probs_and_choices():
    cfg = tiny_config()
    variables = random_variables(cfg)
    tokens = jnp.asarray(np.arange(3, 19)[None])
    (logits, aux), inter = jax.jit(functools.partial(Zaya(cfg).apply, mutable=["intermediates"]))(
        variables, tokens
    )
    rec = {k: v[0] for k, v in inter["intermediates"]["layers"].items()}
    layers, classes = cfg.num_layers, cfg.num_experts + 1
    assert rec["router_state"].shape == (layers, 1, 16, cfg.router_hidden_size)
    assert rec["router_probs"].shape == (layers, 1, 16, classes)
    np.testing.assert_allclose(np.asarray(rec["router_probs"]).sum(-1), 1.0, rtol=1e-5)
    # The recorded choices are the ones the statistics counted, layer by layer.
    counted = jax.nn.one_hot(rec["router_choice"], classes).sum((1, 2))
    np.testing.assert_array_equal(np.asarray(counted), np.asarray(aux["load"]))
    # Recording changes nothing, and without mutable=... nothing is recorded.
    plain, _ = jax.jit(Zaya(cfg).apply)(variables, tokens)
    # two programs, which XLA may fuse differently: equal up to float32 rounding (~3e-7 seen)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(logits), rtol=0, atol=2e-6)


def test_bfloat16_compute_keeps_float32_params_and_residual():
    cfg = tiny_config(dtype="bfloat16")
    variables = random_variables(dataclasses.replace(cfg, dtype="float32"))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables))
    tokens = jnp.asarray(np.arange(3, 19)[None])
    logits, _, inter = _run_with_intermediates(cfg, variables, tokens)
    assert logits.dtype == jnp.bfloat16
    assert inter["post_moe_scale"]["__call__"][0].dtype == jnp.float32
    ref, _, _ = _run_with_intermediates(dataclasses.replace(cfg, dtype="float32"), variables, tokens)
    assert (
        np.abs(np.asarray(logits, np.float32) - np.asarray(ref)).mean() < 0.02 * np.abs(np.asarray(ref)).max()
    )


def _run_with_intermediates(cfg, variables, tokens):
    apply = jax.jit(functools.partial(Zaya(cfg).apply, capture_intermediates=True, mutable=["intermediates"]))
    (logits, aux), state = apply(variables, tokens)
    return logits, aux, state["intermediates"]["layers"]


@pytest.mark.parametrize("moe_impl", ["dense", "sorted", "capacity"])
def test_scaled_input_skip_adds_p_skip_times_normed_input(moe_impl):
    """Legacy MOD semantics: a skip-routed token's MoE output is p_skip * m instead of 0 (spec §7 Q1)."""
    zero = tiny_config(num_layers=1, moe_impl=moe_impl, capacity_factor=4.0)
    scaled = dataclasses.replace(zero, mod_skip_output="scaled_input")
    variables = random_variables(zero, seed=3)
    tokens = jnp.asarray(np.arange(3, 15)[None])
    logits_zero, aux, _ = _run_with_intermediates(zero, variables, tokens)
    logits_scaled, _, _ = _run_with_intermediates(scaled, variables, tokens)
    assert aux["load"][0, -1] == 0  # default skip bias -1: nobody skips, so both semantics agree
    # two programs, which XLA may fuse differently: equal up to float32 rounding (~5e-7 seen)
    np.testing.assert_allclose(logits_zero, logits_scaled, rtol=0, atol=2e-6)

    forced = {**variables, BALANCING: jax.tree.map(lambda b: b.at[:, -1].set(2.0), variables[BALANCING])}
    _, aux, inter_zero = _run_with_intermediates(zero, forced, tokens)
    _, _, inter_scaled = _run_with_intermediates(scaled, forced, tokens)
    assert aux["load"][0, -1] == tokens.size
    m = inter_zero["post_attn_norm"]["__call__"][0][0]
    p_skip = inter_zero["router"]["__call__"][0].probs[0][..., -1]
    scale = forced["params"]["layers"]["post_moe_scale"]["hidden_scale"][0]
    delta = inter_scaled["post_moe_scale"]["__call__"][0][0] - inter_zero["post_moe_scale"]["__call__"][0][0]
    np.testing.assert_allclose(delta, p_skip[..., None] * m * scale, atol=1e-5)
    assert np.abs(delta).max() > 1e-2


def test_remat_policies_keep_gradients_and_cut_saved_activations():
    cfg = tiny_config()
    variables = random_variables(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.vocab_size)
    results = {}
    for remat in ("none", "minimal", "full"):
        model = Zaya(dataclasses.replace(cfg, remat=remat))

        def loss(params, model=model):
            logits, _ = model.apply({**variables, "params": params}, tokens)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

        compiled = jax.jit(jax.value_and_grad(loss)).lower(variables["params"]).compile()
        results[remat] = (compiled(variables["params"]), compiled.memory_analysis().temp_size_in_bytes)
    (loss_ref, grads_ref), temp_none = results["none"]
    for remat in ("minimal", "full"):
        (loss_r, grads_r), _ = results[remat]
        np.testing.assert_allclose(loss_r, loss_ref, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads_ref), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-12, rtol=0)
    # Fewer activations kept across the scan: the compiled temporaries shrink.
    assert results["full"][1] < results["minimal"][1] < temp_none


def test_remat_minimal_keeps_weight_matmul_outputs_but_recomputes_o_proj():
    # remat "minimal" keeps the outputs of weight matmuls across the layer scan, except o_proj's,
    # which only the residual scale's gradient reads (a stacked copy per layer, held twice in
    # ZAYA1-8B's 4k plan): the other (layers, rows, seq, hidden) arrays kept are the ones named here.
    cfg = dataclasses.replace(tiny_config(), remat="minimal")
    variables = random_variables(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.vocab_size)

    def loss(params):
        logits, _ = Zaya(cfg).apply({**variables, "params": params}, tokens)
        return jnp.mean(logits)

    def kept_hidden_width(recompute_o_proj: bool) -> int:
        out = io.StringIO()
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
            if not recompute_o_proj:  # the plain weight matmul, as before
                patch.setattr(Dense, "recomputed", property(lambda self: False, lambda self, v: None))
            print_saved_residuals(loss, variables["params"])  # one line per kept array: "dtype[shape] ..."
        stacked = f"[{cfg.num_layers},2,64,{cfg.hidden_size}]"
        return sum(line.split(" ")[0].endswith(stacked) for line in out.getvalue().splitlines())

    assert kept_hidden_width(recompute_o_proj=False) == kept_hidden_width(recompute_o_proj=True) + 1


def test_unrolled_layer_scan_gives_the_same_gradients_without_a_loop():
    cfg = tiny_config()
    variables = random_variables(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
    results = {}
    for unroll in (1, cfg.num_layers):
        # capacity: the CPU sorted path has loops of its own (blocked_grouped_matmul's lax.map)
        model = Zaya(dataclasses.replace(cfg, scan_unroll=unroll, moe_impl="capacity"))

        def loss(params, model=model):
            logits, _ = model.apply({**variables, "params": params}, tokens)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

        lowered = jax.jit(jax.value_and_grad(loss)).lower(variables["params"])
        results[unroll] = (lowered.compile()(variables["params"]), lowered.as_text().count("stablehlo.while"))
    (loss_1, grads_1), loops_1 = results[1]
    (loss_u, grads_u), loops_u = results[cfg.num_layers]
    assert loops_1 >= 2 and loops_u == 0  # forward and backward scans vs. straight-line code
    np.testing.assert_allclose(loss_u, loss_1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_u), jax.tree.leaves(grads_1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-12, rtol=0)


def test_blocked_and_dense_attention_give_the_same_model():
    """The default blocked kernel against the dense definition inside the whole model: packed
    documents, padding and a sliding-window layer, logits and parameter gradients."""
    cfg = tiny_config(layer_types=("hybrid", "hybrid_sliding"), sliding_window=5, attention_block=8)
    variables = random_variables(cfg)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 29)))
    segments = np.ones((2, 29), np.int32)
    segments[0, 11:] = 2
    segments[1, 25:] = 0  # right padding
    kwargs = {"segment_ids": jnp.asarray(segments), "token_mask": jnp.asarray(segments > 0)}

    def run(impl):
        model = Zaya(dataclasses.replace(cfg, attention_impl=impl))

        def loss(params):
            logits, _ = model.apply({**variables, "params": params}, tokens, **kwargs)
            return jnp.sum(jnp.sin(logits) * (segments > 0)[..., None]), logits

        return jax.jit(jax.grad(loss, has_aux=True))(variables["params"])

    (g_blocked, blocked), (g_dense, dense) = run("blocked"), run("dense")
    real = segments > 0
    np.testing.assert_allclose(np.asarray(blocked)[real], np.asarray(dense)[real], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_dense), strict=True):
        scale = max(float(np.max(np.abs(b))), 1e-6)
        assert float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) <= 1e-5 * scale
