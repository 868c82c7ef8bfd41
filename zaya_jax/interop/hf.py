"""Hugging Face ``ZayaForCausalLM`` <-> zaya-jax weights and configs (spec §1, §6.3).

Inbound: a ``save_pretrained`` directory (config.json + safetensors, tied head absent) or the legacy
ZAYA1-base layout (80 alternating half-layers, renamed per spec §6.3) becomes a ``ModelConfig`` and
a variables tree ``{"params": ..., "balancing": ...}``. Only safetensors is read, never pickle.
Every mismatch (missing, unexpected or mis-shaped tensors) is reported at once.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from zaya_jax.config import ConfigError, ModelConfig, model_config_from_dict
from zaya_jax.files import write_atomic
from zaya_jax.interop.safetensors_io import SHARD_BYTES, read_directory, write_directory
from zaya_jax.model import BALANCING, abstract_variables


class ConversionError(ValueError):
    """Weights that do not fit the model; the message lists every offending tensor."""


# ---------------------------------------------------------------------------------------------
# Configs


def _rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    params = hf.get("rope_parameters")
    if params is None:  # pre-5.x style flat field
        theta = float(hf.get("rope_theta", ModelConfig.rope_theta))
        return {"rope_theta": theta, "rope_theta_sliding": theta}
    if "rope_theta" in params:  # one dict for every layer type
        params = {"hybrid": params, "hybrid_sliding": params}
    out: dict[str, Any] = {}
    factors = set()
    for layer_type, key in (("hybrid", "rope_theta"), ("hybrid_sliding", "rope_theta_sliding")):
        entry = params.get(layer_type)
        if entry is None:
            continue
        if entry.get("rope_type", "default") != "default":
            raise ConfigError(
                f"rope_parameters[{layer_type!r}].rope_type={entry['rope_type']!r}: only 'default' RoPE is supported"
            )
        out[key] = float(entry["rope_theta"])
        factors.add(float(entry.get("partial_rotary_factor", 1.0)))
    if len(factors) > 1:
        raise ConfigError(
            f"rope_parameters use different partial_rotary_factor per layer type {sorted(factors)}; one value is supported"
        )
    if factors:
        out["partial_rotary_factor"] = factors.pop()
    return out


def _first_token_id(value: Any, default: int) -> int:
    if value is None:
        return default
    return int(value[0]) if isinstance(value, list | tuple) else int(value)


def _token_id_list(value: Any) -> tuple[int, ...]:
    """HF's ``eos_token_id`` list, kept whole (an int: empty, ``eos_token_id`` says it all)."""
    return tuple(int(v) for v in value) if isinstance(value, list | tuple) else ()


def hf_config_to_model(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig from an HF ``config.json`` dict (new layout, or legacy ZAYA1-base with ``zaya_layers``)."""
    if "zaya_layers" in hf:
        return _legacy_config_to_model(hf, **overrides)
    layer_types = hf.get("layer_types")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    fields: dict[str, Any] = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf["num_key_value_heads"],
        "head_dim": head_dim,
        "cca_time0": hf.get("cca_time0", 2),
        "cca_time1": hf.get("cca_time1", 2),
        "attention_bias": bool(hf.get("attention_bias", False)),
        "layer_types": None if not layer_types or set(layer_types) == {"hybrid"} else list(layer_types),
        "sliding_window": hf.get("sliding_window"),
        "max_position_embeddings": hf.get("max_position_embeddings", ModelConfig.max_position_embeddings),
        "num_experts": hf["num_experts"],
        "num_experts_per_tok": hf.get("num_experts_per_tok", 1),
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "router_hidden_size": hf.get("router_hidden_size", ModelConfig.router_hidden_size),
        "hidden_act": hf.get("hidden_act", "silu"),
        "rms_norm_eps": float(hf.get("rms_norm_eps", ModelConfig.rms_norm_eps)),
        "initializer_range": float(hf.get("initializer_range", ModelConfig.initializer_range)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "lm_head_bias": bool(hf.get("lm_head_bias", False)),
        "pad_token_id": _first_token_id(hf.get("pad_token_id"), 0),
        "bos_token_id": _first_token_id(hf.get("bos_token_id"), ModelConfig.bos_token_id),
        "eos_token_id": _first_token_id(hf.get("eos_token_id"), ModelConfig.eos_token_id),
        "eos_token_ids": _token_id_list(hf.get("eos_token_id")),
        **_rope_fields(hf),
    }
    return model_config_from_dict({**fields, **overrides})


def _legacy_config_to_model(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """Legacy ``Zyphra/transformers@zaya`` configs: attention/MoE half-layers listed in ``zaya_layers``."""
    layers = hf["zaya_layers"]
    if len(layers) % 2 or any(layers[i] != "a" for i in range(0, len(layers), 2)):
        raise ConfigError(
            "legacy zaya_layers must alternate attention ('a') and MoE (expert count) half-layers"
        )
    if any(hf.get(key) for key in ("swa_layers", "sliding_window")):
        raise ConfigError(
            "legacy configs with sliding-window layers are not supported; convert with transformers first"
        )
    hidden = hf["hidden_size"]
    fields = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hidden,
        "num_layers": len(layers) // 2,
        "num_heads": hf["cca_num_q_heads"][0],
        "num_kv_heads": hf["num_query_groups_list"][0],
        "head_dim": hidden // hf["num_attention_heads"],
        "num_experts": int(layers[1]),
        "moe_intermediate_size": hf["ffn_hidden_size_list"][1] // 2,
        "router_hidden_size": hf["zaya_mlp_expansion"][1],
        "rope_theta": float(hf.get("rope_theta", 10_000.0)),
        "rope_theta_sliding": float(hf.get("rope_theta", 10_000.0)),
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "rms_norm_eps": float(hf.get("rms_norm_eps", hf.get("norm_epsilon", 1e-5))),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "pad_token_id": _first_token_id(hf.get("pad_token_id"), 0),
        "bos_token_id": _first_token_id(hf.get("bos_token_id"), 2),
        "eos_token_id": _first_token_id(hf.get("eos_token_id"), 1),
        "eos_token_ids": _token_id_list(hf.get("eos_token_id")),
    }
    return model_config_from_dict({**fields, **overrides})


def model_to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The HF ``ZayaConfig`` keyword arguments describing ``cfg``."""
    rope = {
        "hybrid": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        "hybrid_sliding": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta_sliding,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
    }
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "cca_time0": cfg.cca_time0,
        "cca_time1": cfg.cca_time1,
        "attention_bias": cfg.attention_bias,
        "rope_parameters": rope,
        "layer_types": list(cfg.resolved_layer_types),
        "sliding_window": cfg.sliding_window,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "router_hidden_size": cfg.router_hidden_size,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "lm_head_bias": cfg.lm_head_bias,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else cfg.eos_token_id,
    }


# ---------------------------------------------------------------------------------------------
# Weight layouts. Each transform maps an HF tensor to ours; ``_TO_HF`` is its inverse.

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


@dataclasses.dataclass(frozen=True)
class _Entry:
    hf_name: str
    collection: str  # "params" or BALANCING
    path: tuple[str, ...]  # inside the collection
    transform: str
    layer: int | None = None  # stacked index along the scanned layer axis (None: not stacked)
    eda_row: int | None = None  # row of the (L-1, R) router_states_scale


def _residual_entries(prefix: str, hf_module: str, ours: str, layer: int) -> list[_Entry]:
    pairs = [
        ("hidden_states_scale", "hidden_scale"),
        ("hidden_states_bias", "hidden_bias"),
        ("residual_scale", "residual_scale"),
        ("residual_bias", "residual_bias"),
    ]
    return [
        _Entry(f"{prefix}{hf_module}.{h}", "params", ("layers", ours, o), "copy", layer) for h, o in pairs
    ]


def weight_layout(cfg: ModelConfig) -> list[_Entry]:
    """Every HF tensor of a ``save_pretrained`` checkpoint of ``cfg`` and where it lives in ours."""
    entries = [
        _Entry("model.embed_tokens.weight", "params", ("embedding",), "copy"),
        _Entry("model.input_hidden_states_scale", "params", ("input_scale",), "copy"),
        _Entry("model.input_hidden_states_bias", "params", ("input_bias",), "copy"),
        _Entry("model.norm.weight", "params", ("final_norm", "scale"), "copy"),
    ]
    if not cfg.tie_word_embeddings:
        entries.append(_Entry("lm_head.weight", "params", ("lm_head", "kernel"), "linear"))
    if cfg.lm_head_bias:
        path = ("lm_head", "bias") if not cfg.tie_word_embeddings else ("lm_head_bias",)
        entries.append(_Entry("lm_head.bias", "params", path, "copy"))
    attn_linears = [
        ("q_proj", "q_proj"),
        ("k_proj", "k_proj"),
        ("v_proj_current", "v_current"),
        ("v_proj_delayed", "v_delayed"),
    ]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = [
            _Entry(f"{p}input_layernorm.weight", "params", ("layers", "input_norm", "scale"), "copy", i),
            _Entry(
                f"{p}post_attention_layernorm.weight",
                "params",
                ("layers", "post_attn_norm", "scale"),
                "copy",
                i,
            ),
            _Entry(
                f"{p}self_attn.o_proj.weight", "params", ("layers", "attn", "o_proj", "kernel"), "linear", i
            ),
            _Entry(f"{p}self_attn.qk_norm.temp", "params", ("layers", "attn", "temp"), "copy", i),
            _Entry(
                f"{p}self_attn.qkv_proj.conv_qk_depthwise.weight",
                "params",
                ("layers", "attn", "conv_dw_kernel"),
                "conv_dw",
                i,
            ),
            _Entry(
                f"{p}self_attn.qkv_proj.conv_qk_depthwise.bias",
                "params",
                ("layers", "attn", "conv_dw_bias"),
                "copy",
                i,
            ),
            _Entry(
                f"{p}self_attn.qkv_proj.conv_qk_grouped.weight",
                "params",
                ("layers", "attn", "conv_grouped_kernel"),
                "conv_grouped",
                i,
            ),
            _Entry(
                f"{p}self_attn.qkv_proj.conv_qk_grouped.bias",
                "params",
                ("layers", "attn", "conv_grouped_bias"),
                "copy",
                i,
            ),
            _Entry(
                f"{p}mlp.gate.down_proj.weight", "params", ("layers", "router", "down", "kernel"), "linear", i
            ),
            _Entry(f"{p}mlp.gate.down_proj.bias", "params", ("layers", "router", "down", "bias"), "copy", i),
            _Entry(
                f"{p}mlp.gate.router_mlp.norm.weight",
                "params",
                ("layers", "router", "norm", "scale"),
                "copy",
                i,
            ),
            _Entry(
                f"{p}mlp.gate.router_mlp.out_proj.weight",
                "params",
                ("layers", "router", "out", "kernel"),
                "linear",
                i,
            ),
            _Entry(f"{p}mlp.gate.balancing_biases", BALANCING, ("layers", "router", "biases"), "copy", i),
            _Entry(f"{p}mlp.experts.gate_up_proj", "params", ("layers", "experts", "wi"), "experts", i),
            _Entry(f"{p}mlp.experts.down_proj", "params", ("layers", "experts", "wo"), "experts", i),
        ]
        for fc in ("fc1", "fc2"):
            layer.append(
                _Entry(
                    f"{p}mlp.gate.router_mlp.{fc}.weight",
                    "params",
                    ("layers", "router", fc, "kernel"),
                    "linear",
                    i,
                )
            )
            layer.append(
                _Entry(
                    f"{p}mlp.gate.router_mlp.{fc}.bias", "params", ("layers", "router", fc, "bias"), "copy", i
                )
            )
        for hf_name, ours in attn_linears:
            base = f"{p}self_attn.qkv_proj.{hf_name}"
            layer.append(_Entry(f"{base}.weight", "params", ("layers", "attn", ours, "kernel"), "linear", i))
            if cfg.attention_bias:
                layer.append(_Entry(f"{base}.bias", "params", ("layers", "attn", ours, "bias"), "copy", i))
        if cfg.attention_bias:
            layer.append(
                _Entry(f"{p}self_attn.o_proj.bias", "params", ("layers", "attn", "o_proj", "bias"), "copy", i)
            )
        if i > 0:
            layer.append(
                _Entry(
                    f"{p}mlp.gate.router_states_scale",
                    "params",
                    ("router_states_scale",),
                    "copy",
                    eda_row=i - 1,
                )
            )
        layer += _residual_entries(p, "post_attention_residual_scale", "post_attn_scale", i)
        layer += _residual_entries(p, "post_mlp_residual_scale", "post_moe_scale", i)
        entries += layer
    return entries


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _hf_shape(entry: _Entry, ours: jax.ShapeDtypeStruct, cfg: ModelConfig) -> tuple[int, ...]:
    shape = ours.shape[1:] if entry.layer is not None or entry.eda_row is not None else ours.shape
    spec = jax.ShapeDtypeStruct(shape, ours.dtype)
    return tuple(jax.eval_shape(lambda w: _TO_HF[entry.transform](w, cfg), spec).shape)


def _format_names(names: list[str], limit: int = 12) -> str:
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
        problems.append(f"missing {len(missing)}: {_format_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_format_names(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped {len(misshaped)}: {_format_names(misshaped)}")
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


# ---------------------------------------------------------------------------------------------
# Legacy (ZAYA1-base) layout: 80 half-layers; attention at 2i, MoE at 2i+1 (spec §6.3).

_LEGACY_ATTN = {
    "self_attn.qkv.linear_q.": "self_attn.qkv_proj.q_proj.",
    "self_attn.qkv.linear_k.": "self_attn.qkv_proj.k_proj.",
    "self_attn.qkv.val_proj1.": "self_attn.qkv_proj.v_proj_current.",
    "self_attn.qkv.val_proj2.": "self_attn.qkv_proj.v_proj_delayed.",
    "self_attn.qkv.conv_qk.0.": "self_attn.qkv_proj.conv_qk_depthwise.",
    "self_attn.qkv.conv_qk.1.": "self_attn.qkv_proj.conv_qk_grouped.",
    "self_attn.qkv.temp": "self_attn.qk_norm.temp",
    "self_attn.o_proj.": "self_attn.o_proj.",
    "input_norm.": "input_layernorm.",
}
_LEGACY_MOE = {
    "input_norm.": "post_attention_layernorm.",
    "zaya_block.router.down_proj.": "mlp.gate.down_proj.",
    "zaya_block.router.router_states_scale": "mlp.gate.router_states_scale",
    "zaya_block.router.rmsnorm_eda.": "mlp.gate.router_mlp.norm.",
    "zaya_block.router.router_mlp.0.": "mlp.gate.router_mlp.fc1.",
    "zaya_block.router.router_mlp.2.": "mlp.gate.router_mlp.fc2.",
    "zaya_block.router.router_mlp.4.": "mlp.gate.router_mlp.out_proj.",
    "zaya_block.router.balancing_biases": "mlp.gate.balancing_biases",
}
_LEGACY_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LEGACY_EXPERT = re.compile(r"^zaya_block\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def is_legacy_layout(names: Any) -> bool:
    return any(".zaya_block." in n or ".self_attn.qkv.linear_q." in n for n in names)


def legacy_to_hf(tensors: Mapping[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """Rename a legacy half-layer state dict to HF new-layout names; stack per-expert matrices.

    The legacy residual scaling of half-layer n is applied at the start of half-layer n+1: layer 0's
    becomes the input scaling, MoE half-layer 2i+1's block i's post-attention scaling, attention
    half-layer 2i+2's block i's post-MoE scaling, and the final ``model.res_scale`` block L-1's.
    """
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    unknown = []
    for name, value in tensors.items():
        if name == "model.embed_tokens.weight" or name == "lm_head.weight":
            out[name] = value
            continue
        if name == "model.final_norm.weight":
            out["model.norm.weight"] = value
            continue
        if name.startswith("model.res_scale."):
            out[
                f"model.layers.{num_layers - 1}.post_mlp_residual_scale.{name.removeprefix('model.res_scale.')}"
            ] = value
            continue
        match = _LEGACY_LAYER.match(name)
        if match is None:
            unknown.append(name)
            continue
        half, rest = int(match.group(1)), match.group(2)
        block, is_moe = divmod(half, 2)
        if rest.startswith("res_scale."):
            part = rest.removeprefix("res_scale.")
            if half == 0:
                out[f"model.input_{part}"] = value
            elif is_moe:
                out[f"model.layers.{block}.post_attention_residual_scale.{part}"] = value
            else:
                out[f"model.layers.{block - 1}.post_mlp_residual_scale.{part}"] = value
            continue
        expert = _LEGACY_EXPERT.match(rest)
        if is_moe and expert:
            kind = "gate_up_proj" if expert.group(2) == "1" else "down_proj"
            experts.setdefault((block, kind), {})[int(expert.group(1))] = value
            continue
        table = _LEGACY_MOE if is_moe else _LEGACY_ATTN
        for old, new in table.items():
            if rest.startswith(old):
                out[f"model.layers.{block}.{new}{rest.removeprefix(old)}"] = value
                break
        else:
            unknown.append(name)
    for (block, kind), by_index in experts.items():
        indices = sorted(by_index)
        if indices != list(range(len(indices))):
            raise ConversionError(f"legacy block {block} {kind}: expert indices {indices} are not 0..E-1")
        out[f"model.layers.{block}.mlp.experts.{kind}"] = np.stack([by_index[e] for e in indices])
    if unknown:
        raise ConversionError(f"unrecognised legacy tensors: {_format_names(sorted(unknown))}")
    return out


# ---------------------------------------------------------------------------------------------
# Directories


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConversionError(
            f"{directory} has no config.json; expected a Hugging Face save_pretrained directory"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConversionError(f"{path} is not valid UTF-8 JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not an object of config fields")
    model_type = data.get("model_type")
    if model_type not in (None, "zaya"):
        raise ConversionError(f"{path}: model_type is {model_type!r}, not 'zaya'")
    return data


def hf_directory_model(directory: str | Path, **overrides: Any) -> ModelConfig:
    """The ModelConfig of an HF ``save_pretrained`` directory's ``config.json``; a missing field is a
    :class:`ConversionError` naming the field and the file."""
    try:
        cfg = hf_config_to_model(read_hf_config(directory), **overrides)
    except KeyError as err:
        raise ConversionError(
            f"{Path(directory) / 'config.json'} lacks the field {err.args[0]!r}, which a ZAYA config needs; "
            "is it a complete save_pretrained config?"
        ) from None
    # generation_config.json may hold the full EOS list where config.json has one id
    generation = Path(directory) / "generation_config.json"
    if not cfg.eos_token_ids and "eos_token_ids" not in overrides and generation.is_file():
        listed = _token_id_list(json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id"))
        if listed:
            cfg = dataclasses.replace(cfg, eos_token_ids=listed)
            cfg.validate()
    return cfg


def load_hf_directory(directory: str | Path, **overrides: Any) -> tuple[ModelConfig, dict[str, Any]]:
    """Read an HF ``save_pretrained`` directory (new or legacy layout) -> (ModelConfig, variables)."""
    cfg = hf_directory_model(directory, **overrides)
    tensors = read_directory(directory)
    if is_legacy_layout(tensors):
        tensors = legacy_to_hf(tensors, cfg.num_layers)
    return cfg, hf_to_variables(tensors, cfg)


def save_hf_directory(
    directory: str | Path,
    cfg: ModelConfig,
    variables: Mapping[str, Any],
    dtype: str = "float32",
    max_shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write a ``save_pretrained``-compatible directory: config.json, generation_config.json (the
    special ids; generation stops on every id of the EOS list) and the weights (tied head omitted)
    as model.safetensors, or shards of at most ``max_shard_bytes`` with model.safetensors.index.json.
    Every file is written atomically and config.json last, so an interrupted write never leaves a
    directory that looks complete; ``zaya convert`` (:func:`zaya_jax.lm.export_hf`) also builds the
    whole directory beside its destination and renames it into place.

    ``transformers`` implements only the ``zero`` MOD-skip semantics, so ``scaled_input`` models are refused.
    """
    if cfg.mod_skip_output != "zero":
        raise ConversionError(
            f"model.mod_skip_output={cfg.mod_skip_output!r} has no Hugging Face equivalent (HF zeroes "
            "skip-routed tokens); only 'zero' models can be exported"
        )
    if dtype not in ("float32", "bfloat16"):
        raise ConversionError(f"dtype {dtype!r} is not supported; use float32 or bfloat16")
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not empty; choose a new destination")
    directory.mkdir(parents=True, exist_ok=True)
    numpy_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {
        name: value.astype(np.float32 if name.endswith("balancing_biases") else numpy_dtype)
        for name, value in variables_to_hf(variables, cfg).items()
    }
    write_directory(directory, tensors, max_shard_bytes)
    generation = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }
    write_atomic(directory / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    config = {
        "architectures": ["ZayaForCausalLM"],
        "model_type": "zaya",
        "dtype": dtype,
        **model_to_hf_config(cfg),
    }
    # Last: a directory with config.json holds every file (transformers and zaya_jax.load look for it).
    write_atomic(directory / "config.json", json.dumps(config, indent=2) + "\n")
    return directory
