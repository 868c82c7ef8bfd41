"""LoRA adapters on the parameter tree: the roles and refusals, one factor pair per expert and
layer in the right orientation (a square expert ``wo`` included, where a transposed product passes
every shape check), the base bit for bit while ``B`` is zero, and a gradient for every adapter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures import MINI
from zaya_jax.config import ConfigError, LoraConfig, load_config
from zaya_jax.lora import inert, init_adapters, merge, targeted
from zaya_jax.model import Zaya, init_variables

CFG = load_config("tiny", MINI).model  # hidden 32 == expert intermediate 32: wo is square
VARIABLES = init_variables(CFG, 0)
PARAMS = VARIABLES["params"]


def Lora(rank, **kwargs):
    lora = LoraConfig(rank, **kwargs)
    lora.validate()
    return lora


def test_targets_are_roles_and_the_router_is_refused():
    assert CFG.hidden_size == CFG.moe_intermediate_size
    assert targeted(PARAMS, Lora(4, targets=("experts",))) == ["layers/experts/wi", "layers/experts/wo"]
    assert len(targeted(PARAMS, Lora(4))) == 7  # experts' wi, wo and CCA's five projections
    for role, reason in (("router", "argmax"), ("balancing", "controller"), ("eda", "router")):
        with pytest.raises(ConfigError, match=f"lora.targets: '{role}' is refused: .*{reason}"):
            Lora(4, targets=(role,))
    with pytest.raises(ConfigError, match="unknown role 'mlp'; the roles are experts, attention"):
        Lora(4, targets=("mlp",))
    with pytest.raises(ConfigError, match="rank=-1 must be an integer >= 0"):
        Lora(-1)


def test_one_adapter_per_expert_and_layer_starting_at_the_base_bit_for_bit():
    lora = Lora(3, alpha=6.0)
    adapters = init_adapters(PARAMS, lora, jax.random.key(1))
    layers, experts, embed, inner = PARAMS["layers"]["experts"]["wo"].shape
    assert adapters["layers/experts/wo"]["a"].shape == (layers, experts, embed, 3)
    assert adapters["layers/experts/wo"]["b"].shape == (layers, experts, 3, inner)
    merged = merge(PARAMS, adapters, lora)
    for (path, base), (_, out) in zip(
        jax.tree_util.tree_leaves_with_path(PARAMS), jax.tree_util.tree_leaves_with_path(merged), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(base), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("rslora", [False, True])
def test_each_merged_expert_computes_x_w_plus_s_x_a_b(rslora):
    """Per layer and expert, the merged weight applied to x equals the base's x @ W plus the
    factored s * (x @ A) @ B; the transposed product, which has the same shape on the square wo,
    does not."""
    lora = Lora(2, alpha=4.0, rslora=rslora)
    assert lora.scale == (4.0 / np.sqrt(2) if rslora else 2.0)
    adapters = init_adapters(PARAMS, lora, jax.random.key(2))
    for factors in adapters.values():
        factors["b"] = jax.random.normal(jax.random.key(3), factors["b"].shape)
    merged = merge(PARAMS, adapters, lora)
    x = np.asarray(jax.random.normal(jax.random.key(4), (5, CFG.hidden_size)))
    for name in ("wi", "wo"):
        w, a, b = (
            np.asarray(t)
            for t in (PARAMS["layers"]["experts"][name], *adapters[f"layers/experts/{name}"].values())
        )
        out = np.asarray(merged["layers"]["experts"][name])
        for layer in range(w.shape[0]):
            for e in range(w.shape[1]):
                expected = x @ w[layer, e] + lora.scale * (x @ a[layer, e]) @ b[layer, e]
                np.testing.assert_allclose(x @ out[layer, e], expected, rtol=1e-5, atol=1e-6)
                if name == "wo":
                    transposed = x @ (w[layer, e] + lora.scale * (a[layer, e] @ b[layer, e]).T)
                    assert not np.allclose(transposed, expected, rtol=1e-3)


def _adapter_grads(params, lora):
    adapters = init_adapters(params, lora, jax.random.key(5))
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 3, CFG.vocab_size)

    def loss(adapters):
        merged = merge(jax.lax.stop_gradient(params), adapters, lora)
        logits, _ = Zaya(CFG).apply({**VARIABLES, "params": merged}, tokens)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 7])

    return jax.grad(loss)(adapters)


def test_every_adapter_gets_a_gradient_through_the_model_and_an_inert_one_is_named():
    """With a trained CCA temperature every adapter's B gets a gradient (A none yet: B is zero). A
    freshly initialised base has temperature 0, i.e. uniform attention, where q and k have no
    gradient at all: frozen, their adapters would never train, and the guard names them."""
    trained = jax.tree.map(lambda x: x, PARAMS)
    trained["layers"]["attn"]["temp"] = jnp.full_like(PARAMS["layers"]["attn"]["temp"], 0.5)
    grads = _adapter_grads(trained, Lora(2))
    assert inert(grads) == []
    assert all(not np.any(np.asarray(g["a"])) for g in grads.values())
    assert not np.any(np.asarray(PARAMS["layers"]["attn"]["temp"]))
    assert inert(_adapter_grads(PARAMS, Lora(2))) == [
        "layers/attn/k_proj/kernel",
        "layers/attn/q_proj/kernel",
    ]


def test_factors_that_do_not_fit_their_weight_are_refused():
    lora = Lora(2, targets=("experts",))
    adapters = init_adapters(PARAMS, lora, jax.random.key(7))
    adapters["layers/experts/wo"]["b"] = jnp.swapaxes(adapters["layers/experts/wi"]["b"], -1, -2)[..., :1, :]
    with pytest.raises(ValueError, match="do not fit layers/experts/wo"):
        merge(PARAMS, adapters, lora)
    with pytest.raises(
        ValueError, match="adapters for weights the targets do not name: layers/attn/q_proj/kernel"
    ):
        merge(PARAMS, {**adapters, "layers/attn/q_proj/kernel": adapters["layers/experts/wi"]}, lora)


@pytest.mark.parametrize("moe_impl", ["sorted", "capacity", "dense"])
def test_the_model_folds_adapters_per_block_as_the_merged_weights_compute(moe_impl):
    """The adapters carried in the parameters (folded per block inside the scan) give the logits of
    the merged weights on every MoE path, the square wo included."""
    import dataclasses

    from zaya_jax.lora import attach
    from zaya_jax.model.lowrank import merged

    cfg = dataclasses.replace(CFG, moe_impl=moe_impl, capacity_factor=4.0)
    lora = Lora(2, alpha=4.0, targets=("experts", "attention", "embeddings"))
    adapters = init_adapters(PARAMS, lora, jax.random.key(8))
    for i, factors in enumerate(adapters.values()):
        factors["b"] = 0.1 * jax.random.normal(jax.random.key(9 + i), factors["b"].shape)
    carried = attach(PARAMS, adapters, lora)
    tokens = jax.random.randint(jax.random.key(10), (2, 16), 3, CFG.vocab_size)
    model = Zaya(cfg)
    folded = np.asarray(model.apply({**VARIABLES, "params": carried}, tokens)[0])
    plain = np.asarray(model.apply({**VARIABLES, "params": merged(carried)}, tokens)[0])
    base = np.asarray(model.apply(VARIABLES, tokens)[0])
    scale = np.abs(plain).max()
    assert np.abs(folded - plain).max() <= 1e-5 * scale
    assert np.abs(folded - base).max() > 1e-2 * scale


@pytest.mark.parametrize("remat", ["none", "minimal", "full"])
def test_adapter_gradients_through_the_model_equal_the_merged_weights_under_every_remat(remat):
    """The factors' gradients with the adapters folded as each block reads its weights equal those
    through explicitly merged weights, with and without rematerialisation (an adapter wrapper that
    the remat path dropped once gave all-zero adapter gradients and an unadapted forward)."""
    import dataclasses

    from zaya_jax.lora import adapters_of, attach
    from zaya_jax.model.lowrank import join, split

    cfg = dataclasses.replace(CFG, remat=remat)
    params = jax.tree.map(lambda x: x, PARAMS)
    params["layers"]["attn"]["temp"] = jnp.full_like(PARAMS["layers"]["attn"]["temp"], 0.5)
    lora = Lora(2, alpha=4.0)
    adapters = init_adapters(params, lora, jax.random.key(11))
    for i, factors in enumerate(adapters.values()):
        factors["b"] = 0.1 * jax.random.normal(jax.random.key(12 + i), factors["b"].shape)
    tokens = jax.random.randint(jax.random.key(13), (2, 16), 3, CFG.vocab_size)
    model = Zaya(cfg)

    def objective(p):
        return jnp.mean(jax.nn.log_softmax(model.apply({**VARIABLES, "params": p}, tokens)[0])[..., 5])

    through_merge = jax.grad(lambda a: objective(merge(params, a, lora)))(adapters)
    trained, frozen = split(attach(params, adapters, lora))
    folded = adapters_of(jax.grad(lambda t: objective(join(t, frozen)))(trained))
    for path, factors in through_merge.items():
        for which in ("a", "b"):
            expected = np.asarray(factors[which])
            assert np.abs(expected).max() > 0, (path, which)
            np.testing.assert_allclose(
                np.asarray(folded[path][which]), expected, rtol=1e-4, atol=1e-7 * np.abs(expected).max()
            )
