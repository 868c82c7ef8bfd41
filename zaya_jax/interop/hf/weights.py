"""HF ``ZayaForCausalLM`` tensors <-> zaya-jax variables ``{"params", "balancing"}`` (spec §1).

The correspondence is one literal table (:data:`GLOBAL_WEIGHTS`, :data:`LAYER_WEIGHTS`): HF name,
where the tensor lives in ours, how it is transformed, and when it exists. Every mismatch (missing,
unexpected or mis-shaped tensors) is reported at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from zaya_jax.config import ModelConfig
from zaya_jax.model import BALANCING, abstract_variables


class ConversionError(ValueError):
    """Weights that do not fit the model; the message lists every offending tensor."""


# Each transform maps an HF tensor to ours; ``_TO_HF`` is its inverse.
Transform = Callable[[Any, ModelConfig], Any]


def _conv_grouped_to_ours(w, cfg: ModelConfig):
    # HF (C, d_in, k1) with out channel c = g*d + o  ->  ours (k1, groups, d_in, d_out)
    groups, d = cfg.num_heads + cfg.num_kv_heads, cfg.head_dim
    return w.reshape(groups, d, d, cfg.cca_time1).transpose(3, 0, 2, 1)


def _conv_grouped_to_hf(w, cfg: ModelConfig):
    return w.transpose(1, 3, 2, 0).reshape(cfg.conv_channels, cfg.head_dim, cfg.cca_time1)


_TO_OURS: dict[str, Transform] = {
    "copy": lambda w, cfg: w,
    "linear": lambda w, cfg: w.T,  # (out, in) -> (in, out)
    "conv_dw": lambda w, cfg: w[:, 0, :].T,  # (C, 1, k0) -> (k0, C)
    "conv_grouped": _conv_grouped_to_ours,
    "experts": lambda w, cfg: w.transpose(0, 2, 1),  # (E, 2I, H) -> (E, H, 2I); (E, H, I) -> (E, I, H)
}
_TO_HF: dict[str, Transform] = {
    "copy": lambda w, cfg: w,
    "linear": lambda w, cfg: w.T,
    "conv_dw": lambda w, cfg: w.T[:, None, :],
    "conv_grouped": _conv_grouped_to_hf,
    "experts": lambda w, cfg: w.transpose(0, 2, 1),
}

# When a tensor exists, by model setting.
_WHEN: dict[str, Callable[[ModelConfig], bool]] = {
    "always": lambda cfg: True,
    "untied": lambda cfg: not cfg.tie_word_embeddings,
    "untied and lm_head_bias": lambda cfg: not cfg.tie_word_embeddings and cfg.lm_head_bias,
    "tied and lm_head_bias": lambda cfg: cfg.tie_word_embeddings and cfg.lm_head_bias,
    "attention_bias": lambda cfg: cfg.attention_bias,
}

# (HF name, collection, path in the collection, transform, when)
GLOBAL_WEIGHTS: tuple[tuple[str, str, str, str, str], ...] = (
    ("model.embed_tokens.weight", "params", "embedding", "copy", "always"),
    ("model.input_hidden_states_scale", "params", "input_scale", "copy", "always"),
    ("model.input_hidden_states_bias", "params", "input_bias", "copy", "always"),
    ("model.norm.weight", "params", "final_norm/scale", "copy", "always"),
    ("lm_head.weight", "params", "lm_head/kernel", "linear", "untied"),
    ("lm_head.bias", "params", "lm_head/bias", "copy", "untied and lm_head_bias"),
    ("lm_head.bias", "params", "lm_head_bias", "copy", "tied and lm_head_bias"),
)

# Per block i: "model.layers.{i}." + name, stacked at index i along the scanned layer axis of
# ``layers/...``; ``router_states_scale`` (EDA, blocks 1..L-1) is row i-1 of one (L-1, R) array.
LAYER_WEIGHTS: tuple[tuple[str, str, str, str, str], ...] = (
    ("input_layernorm.weight", "params", "layers/input_norm/scale", "copy", "always"),
    ("post_attention_layernorm.weight", "params", "layers/post_attn_norm/scale", "copy", "always"),
    ("self_attn.o_proj.weight", "params", "layers/attn/o_proj/kernel", "linear", "always"),
    ("self_attn.qk_norm.temp", "params", "layers/attn/temp", "copy", "always"),
    ("self_attn.qkv_proj.conv_qk_depthwise.weight", "params", "layers/attn/conv_dw_kernel", "conv_dw", "always"),
    ("self_attn.qkv_proj.conv_qk_depthwise.bias", "params", "layers/attn/conv_dw_bias", "copy", "always"),
    ("self_attn.qkv_proj.conv_qk_grouped.weight", "params", "layers/attn/conv_grouped_kernel", "conv_grouped", "always"),
    ("self_attn.qkv_proj.conv_qk_grouped.bias", "params", "layers/attn/conv_grouped_bias", "copy", "always"),
    ("mlp.gate.down_proj.weight", "params", "layers/router/down/kernel", "linear", "always"),
    ("mlp.gate.down_proj.bias", "params", "layers/router/down/bias", "copy", "always"),
    ("mlp.gate.router_mlp.norm.weight", "params", "layers/router/norm/scale", "copy", "always"),
    ("mlp.gate.router_mlp.out_proj.weight", "params", "layers/router/out/kernel", "linear", "always"),
    ("mlp.gate.balancing_biases", BALANCING, "layers/router/biases", "copy", "always"),
    ("mlp.experts.gate_up_proj", "params", "layers/experts/wi", "experts", "always"),
    ("mlp.experts.down_proj", "params", "layers/experts/wo", "experts", "always"),
    ("mlp.gate.router_mlp.fc1.weight", "params", "layers/router/fc1/kernel", "linear", "always"),
    ("mlp.gate.router_mlp.fc1.bias", "params", "layers/router/fc1/bias", "copy", "always"),
    ("mlp.gate.router_mlp.fc2.weight", "params", "layers/router/fc2/kernel", "linear", "always"),
    ("mlp.gate.router_mlp.fc2.bias", "params", "layers/router/fc2/bias", "copy", "always"),
    ("self_attn.qkv_proj.q_proj.weight", "params", "layers/attn/q_proj/kernel", "linear", "always"),
    ("self_attn.qkv_proj.q_proj.bias", "params", "layers/attn/q_proj/bias", "copy", "attention_bias"),
    ("self_attn.qkv_proj.k_proj.weight", "params", "layers/attn/k_proj/kernel", "linear", "always"),
    ("self_attn.qkv_proj.k_proj.bias", "params", "layers/attn/k_proj/bias", "copy", "attention_bias"),
    ("self_attn.qkv_proj.v_proj_current.weight", "params", "layers/attn/v_current/kernel", "linear", "always"),
    ("self_attn.qkv_proj.v_proj_current.bias", "params", "layers/attn/v_current/bias", "copy", "attention_bias"),
    ("self_attn.qkv_proj.v_proj_delayed.weight", "params", "layers/attn/v_delayed/kernel", "linear", "always"),
    ("self_attn.qkv_proj.v_proj_delayed.bias", "params", "layers/attn/v_delayed/bias", "copy", "attention_bias"),
    ("self_attn.o_proj.bias", "params", "layers/attn/o_proj/bias", "copy", "attention_bias"),
    ("mlp.gate.router_states_scale", "params", "router_states_scale", "copy", "always"),
    ("post_attention_residual_scale.hidden_states_scale", "params", "layers/post_attn_scale/hidden_scale", "copy", "always"),
    ("post_attention_residual_scale.hidden_states_bias", "params", "layers/post_attn_scale/hidden_bias", "copy", "always"),
    ("post_attention_residual_scale.residual_scale", "params", "layers/post_attn_scale/residual_scale", "copy", "always"),
    ("post_attention_residual_scale.residual_bias", "params", "layers/post_attn_scale/residual_bias", "copy", "always"),
    ("post_mlp_residual_scale.hidden_states_scale", "params", "layers/post_moe_scale/hidden_scale", "copy", "always"),
    ("post_mlp_residual_scale.hidden_states_bias", "params", "layers/post_moe_scale/hidden_bias", "copy", "always"),
    ("post_mlp_residual_scale.residual_scale", "params", "layers/post_moe_scale/residual_scale", "copy", "always"),
    ("post_mlp_residual_scale.residual_bias", "params", "layers/post_moe_scale/residual_bias", "copy", "always"),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Entry:
    hf_name: str
    collection: str  # "params" or BALANCING
    path: tuple[str, ...]  # inside the collection
    transform: str
    layer: int | None = None  # stacked index along the scanned layer axis (None: not stacked)
    eda_row: int | None = None  # row of the (L-1, R) router_states_scale


def weight_layout(cfg: ModelConfig) -> list[_Entry]:
    """Every HF tensor of a ``save_pretrained`` checkpoint of ``cfg`` and where it lives in ours."""
    entries = [
        _Entry(name, collection, tuple(path.split("/")), transform)
        for name, collection, path, transform, when in GLOBAL_WEIGHTS
        if _WHEN[when](cfg)
    ]
    for i in range(cfg.num_layers):
        for name, collection, path, transform, when in LAYER_WEIGHTS:
            if not _WHEN[when](cfg):
                continue
            entry = _Entry(f"model.layers.{i}.{name}", collection, tuple(path.split("/")), transform)
            if path == "router_states_scale":  # block 0 has no previous router state to average
                if i > 0:
                    entries.append(dataclasses.replace(entry, eda_row=i - 1))
            else:
                entries.append(dataclasses.replace(entry, layer=i))
    return entries


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _hf_shape(entry: _Entry, ours: jax.ShapeDtypeStruct, cfg: ModelConfig) -> tuple[int, ...]:
    shape = ours.shape[1:] if entry.layer is not None or entry.eda_row is not None else ours.shape
    spec = jax.ShapeDtypeStruct(shape, ours.dtype)
    return tuple(jax.eval_shape(lambda w: _TO_HF[entry.transform](w, cfg), spec).shape)


def format_names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def hf_to_variables(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
    """Convert an HF state dict (new layout) into ``{"params", "balancing"}`` numpy trees for ``cfg``.

    Raises :class:`ConversionError` listing every missing, unexpected and mis-shaped tensor.
    """
    abstract = abstract_variables(cfg)
    layout = weight_layout(cfg)
    expected = {e.hf_name: e for e in layout}
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - ignorable)
    misshaped = []
    for name, entry in expected.items():
        if name in tensors:
            want = _hf_shape(entry, _get(abstract[entry.collection], entry.path), cfg)
            if tuple(tensors[name].shape) != want:
                misshaped.append(f"{name} {tuple(tensors[name].shape)} (expected {want})")
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {format_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {format_names(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped {len(misshaped)}: {format_names(misshaped)}")
    if problems:
        raise ConversionError("checkpoint does not match the model config: " + "; ".join(problems))

    out: dict[str, Any] = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)
    for entry in layout:
        target = _get(out[entry.collection], entry.path[:-1])
        leaf = entry.path[-1]
        value = np.asarray(_TO_OURS[entry.transform](tensors[entry.hf_name], cfg)).astype(target[leaf].dtype)
        index = entry.layer if entry.layer is not None else entry.eda_row
        if index is None:
            target[leaf] = value
        else:
            target[leaf][index] = value
    return out


def variables_to_hf(variables: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of :func:`hf_to_variables`: an HF state dict (tied ``lm_head.weight`` omitted)."""
    out = {}
    for entry in weight_layout(cfg):
        value = np.asarray(_get(variables[entry.collection], entry.path))
        index = entry.layer if entry.layer is not None else entry.eda_row
        if index is not None:
            value = value[index]
        out[entry.hf_name] = np.ascontiguousarray(_TO_HF[entry.transform](value, cfg))
    return out
