"""HF ``ZayaConfig`` fields <-> :class:`ModelConfig`, both ways; the legacy ZAYA1-base config
(``zaya_layers``) inbound."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zaya_jax.config import ConfigError, ModelConfig, model_config_from_dict


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
        out[key] = float(entry["rope_theta"])
        factors.add(float(entry.get("partial_rotary_factor", 1.0)))
        scaling = _scaling(entry, layer_type)
        if scaling is not None:
            out["rope_scaling" if layer_type == "hybrid" else "rope_scaling_sliding"] = scaling
    out["rope_truncate"] = bool(params.get("truncate", True))  # HF reads it from the outer dict only
    if len(factors) > 1:
        raise ConfigError(
            f"rope_parameters use different partial_rotary_factor per layer type {sorted(factors)}; one value is supported"
        )
    if factors:
        out["partial_rotary_factor"] = factors.pop()
    return out


_SCALING_KEYS = (
    "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
    "mscale_all_dim",
)  # fmt: skip


def _scaling(entry: Mapping[str, Any], layer_type: str) -> dict[str, Any] | None:
    """A ``rope_parameters`` entry's scaling as ``model.rope_scaling`` keys (None: default RoPE)."""
    kind = entry.get("rope_type", entry.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "yarn"):
        raise ConfigError(
            f"rope_parameters[{layer_type!r}].rope_type={kind!r}: zaya supports 'default', 'linear' and 'yarn'"
        )
    return {"rope_type": kind, **{key: entry[key] for key in _SCALING_KEYS if entry.get(key) is not None}}


def _hf_entry(theta: float, cfg: ModelConfig, scaling: Any) -> dict[str, Any]:
    entry = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": cfg.partial_rotary_factor}
    if scaling is not None:
        entry["rope_type"] = scaling.rope_type
        entry.update(
            {key: getattr(scaling, key) for key in _SCALING_KEYS if getattr(scaling, key) is not None}
        )
    return entry


def _first_token_id(value: int | Sequence[int] | None, default: int) -> int:
    if value is None:
        return default
    return int(value[0]) if isinstance(value, list | tuple) else int(value)


def token_id_list(value: int | Sequence[int] | None) -> tuple[int, ...]:
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
        "eos_token_ids": token_id_list(hf.get("eos_token_id")),
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
        "eos_token_ids": token_id_list(hf.get("eos_token_id")),
    }
    return model_config_from_dict({**fields, **overrides})


def model_to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The HF ``ZayaConfig`` keyword arguments describing ``cfg``."""
    rope: dict[str, Any] = {
        "hybrid": _hf_entry(cfg.rope_theta, cfg, cfg.rope_scaling),
        "hybrid_sliding": _hf_entry(cfg.rope_theta_sliding, cfg, cfg.rope_scaling_sliding),
    }
    if not cfg.rope_truncate:
        rope["truncate"] = False
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
        "eos_token_id": hf_eos(cfg),
    }


def hf_eos(cfg: ModelConfig) -> int | list[int]:
    """HF's ``eos_token_id`` for ``cfg``: every id generation stops on (``eos_token_id`` joined with
    ``eos_token_ids``, so a list of extra stops never drops the EOS), one id as an int."""
    stops = cfg.stop_token_ids
    return list(stops) if len(stops) > 1 else stops[0]
