"""Hugging Face ``ZayaForCausalLM`` <-> zaya-jax (spec §1, §6.3): configs both ways (:mod:`.config`),
weights by one literal table (:mod:`.weights`), the legacy ZAYA1-base layout (:mod:`.legacy`), and
``save_pretrained`` directories (:mod:`.directory`). Only safetensors is read, never pickle."""

from zaya_jax.interop.hf.config import hf_config_to_model, model_to_hf_config
from zaya_jax.interop.hf.directory import (
    HF_SKIP_BIAS,
    anchor_skip_bias,
    hf_directory_model,
    is_hf_directory,
    load_hf_directory,
    read_hf_config,
    save_hf_directory,
)
from zaya_jax.interop.hf.legacy import is_legacy_layout, legacy_to_hf
from zaya_jax.interop.hf.weights import (
    GLOBAL_WEIGHTS,
    LAYER_WEIGHTS,
    ConversionError,
    hf_to_variables,
    variables_to_hf,
    weight_layout,
)

__all__ = [
    "GLOBAL_WEIGHTS",
    "HF_SKIP_BIAS",
    "LAYER_WEIGHTS",
    "ConversionError",
    "anchor_skip_bias",
    "hf_config_to_model",
    "hf_directory_model",
    "hf_to_variables",
    "is_hf_directory",
    "is_legacy_layout",
    "legacy_to_hf",
    "load_hf_directory",
    "model_to_hf_config",
    "read_hf_config",
    "save_hf_directory",
    "variables_to_hf",
    "weight_layout",
]
