"""The legacy ZAYA1-base layout (spec §6.3): 80 half-layers, attention at 2i and MoE at 2i+1,
renamed to the ``save_pretrained`` layout's names, per-expert matrices stacked."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np

from zaya_jax.interop.hf.weights import ConversionError, format_names

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


def is_legacy_layout(names: Iterable[str]) -> bool:
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
        raise ConversionError(f"unrecognised legacy tensors: {format_names(sorted(unknown))}")
    return out
