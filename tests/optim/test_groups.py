"""Optimizer groups follow the logical axis names of the real model's parameters."""

from __future__ import annotations

import jax
import pytest

from zaya_jax.config import load_config
from zaya_jax.optim import LeafGroup, describe_groups, model_param_groups, param_groups
from zaya_jax.optim.groups import is_leaf_group


@pytest.fixture(scope="module")
def tiny_groups() -> dict:
    return model_param_groups(load_config("tiny").model)


def test_expert_stacks_are_muon_with_layers_and_experts_batched():
    info = describe_groups(load_config("zaya1-8b").model)  # eval_shape only: nothing is allocated
    wi, wo = info["layers/experts/wi"], info["layers/experts/wo"]
    assert wi["group"] == "muon"
    assert wi["matrix_axes"] == ["embed", "expert_mlp"]
    assert wi["batch_axes"] == ["layers", "experts"]
    assert wi["shape"] == [40, 16, 2048, 4096]
    assert wo["matrix_axes"] == ["expert_mlp", "embed"]


def test_attention_projections_are_muon_over_their_last_two_axes(tiny_groups):
    attn = tiny_groups["layers"]["attn"]
    for name in ("q_proj", "k_proj", "v_current", "v_delayed", "o_proj"):
        assert attn[name]["kernel"] == LeafGroup("muon", (1, 2)), name


def test_embedding_scales_conv_norms_and_router_head_are_adamw(tiny_groups):
    layers = tiny_groups["layers"]
    adamw = {
        "embedding": tiny_groups["embedding"],
        "router_states_scale": tiny_groups["router_states_scale"],
        "final_norm": tiny_groups["final_norm"]["scale"],
        "temp": layers["attn"]["temp"],
        "conv_dw_kernel": layers["attn"]["conv_dw_kernel"],
        "conv_grouped_kernel": layers["attn"]["conv_grouped_kernel"],
        "input_norm": layers["input_norm"]["scale"],
        "residual_scale": layers["post_moe_scale"]["residual_scale"],
        "router_out": layers["router"]["out"]["kernel"],
        "router_down_bias": layers["router"]["down"]["bias"],
    }
    for name, group in adamw.items():
        assert group.group == "adamw" and group.matrix_axes is None, name


def test_adamw_weight_decay_only_on_multi_axis_leaves(tiny_groups):
    layers = tiny_groups["layers"]
    assert tiny_groups["embedding"].decay
    assert layers["router"]["out"]["kernel"].decay
    assert layers["attn"]["conv_dw_kernel"].decay
    # ('layers', X) stacks of vectors are still vectors: no decay.
    assert not tiny_groups["router_states_scale"].decay
    assert not layers["input_norm"]["scale"].decay
    assert not layers["attn"]["temp"].decay
    assert not tiny_groups["input_bias"].decay


def test_router_matrices_follow_router_group():
    cfg = load_config("tiny").model
    default = model_param_groups(cfg)["layers"]["router"]
    moved = model_param_groups(cfg, router_group="adamw")["layers"]["router"]
    for name in ("down", "fc1", "fc2"):
        assert default[name]["kernel"].group == "muon", name
        assert moved[name]["kernel"] == LeafGroup("adamw", None, decay=True), name
    assert default["fc1"]["kernel"].matrix_axes == (1, 2)
    assert moved["out"]["kernel"] == default["out"]["kernel"]


def test_untied_lm_head_is_adamw():
    cfg = load_config("tiny", ["model.tie_word_embeddings=false"]).model
    assert model_param_groups(cfg)["lm_head"]["kernel"] == LeafGroup("adamw", None, decay=True)


def test_groups_come_from_axis_names_not_module_names():
    groups = param_groups({"anything": ("layers", "experts", "expert_mlp", "embed"), "x": ("heads",)})
    assert groups["anything"] == LeafGroup("muon", (2, 3))
    assert groups["x"] == LeafGroup("adamw", None, decay=False)


def test_unknown_axis_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"block/w has logical axis 'mystery'.*_AXIS_ROLES"):
        param_groups({"block": {"w": ("embed", "mystery")}})


def test_describe_groups_covers_every_parameter():
    cfg = load_config("tiny").model
    info = describe_groups(cfg, router_group="adamw")
    assert len(info) == len(
        jax.tree.leaves(model_param_groups(cfg), is_leaf=lambda x: isinstance(x, LeafGroup))
    )
    assert info["layers/router/fc1/kernel"]["group"] == "adamw"
    assert info["embedding"] == {
        "group": "adamw",
        "matrix_axes": None,
        "batch_axes": [],
        "weight_decay": True,
        "axes": ["vocab", "embed"],
        "shape": [264, 128],
    }


def test_matrix_optimizer_adamw_leaves_no_muon_leaf():
    cfg = load_config("tiny").model
    groups = jax.tree.leaves(model_param_groups(cfg, matrix_optimizer="adamw"), is_leaf=is_leaf_group)
    muon = [g for g in jax.tree.leaves(model_param_groups(cfg), is_leaf=is_leaf_group) if g.group == "muon"]
    assert muon and all(g.group == "adamw" for g in groups) and sum(g.decay for g in groups) >= len(muon)
