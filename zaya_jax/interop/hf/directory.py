"""``save_pretrained`` directories: config.json (+ generation_config.json) and safetensors, read
(new or legacy layout) and written (atomically, config.json last)."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from zaya_jax.config import ConfigError, ModelConfig
from zaya_jax.files import read_json, write_atomic
from zaya_jax.interop.hf.config import hf_config_to_model, hf_eos, model_to_hf_config, token_id_list
from zaya_jax.interop.hf.legacy import is_legacy_layout, legacy_to_hf
from zaya_jax.interop.hf.quantized import (
    KINDS,
    check_unquantized,
    compress_experts,
    computed_quantization,
    dequantize_experts,
    expert_quantization_of,
    is_expert,
    quantization_config,
)
from zaya_jax.interop.hf.weights import ConversionError, hf_to_variables, variables_to_hf
from zaya_jax.interop.safetensors_io import INDEX, SHARD_BYTES, read_directory, tensor_shapes, write_directory
from zaya_jax.model.lowrank import has_adapters


def is_hf_directory(path: str | Path) -> bool:
    """Whether ``path`` is (meant to be) a ``save_pretrained`` directory: it has a config.json, an
    index or a safetensors file (even a damaged or dangling one: reading it then names the file)
    and is not a zaya-jax run."""
    path = Path(path)
    if not path.is_dir() or (path / "checkpoints").is_dir():
        return False
    names = ("config.json", INDEX)
    return any(os.path.lexists(path / name) for name in names) or any(path.glob("*.safetensors"))


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    data = read_json(path, "the model config of a Hugging Face save_pretrained directory")
    model_type = data.get("model_type")
    if model_type not in (None, "zaya"):
        raise ConversionError(f"{path}: model_type is {model_type!r}, not 'zaya'")
    return data


def hf_directory_model(directory: str | Path, **overrides: Any) -> ModelConfig:
    """The ModelConfig of an HF ``save_pretrained`` directory's ``config.json``; a missing or
    ill-typed field is an error naming the field and the file."""
    path = Path(directory) / "config.json"
    hf = read_hf_config(directory)
    try:
        cfg = hf_config_to_model(hf, **overrides)
    except KeyError as err:
        raise ConversionError(
            f"{path} lacks the field {err.args[0]!r}, which a ZAYA config needs; is it a complete "
            "save_pretrained config?"
        ) from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise ConversionError(
            f"{path}: a field has the wrong type ({err}); is it a ZAYA config.json?"
        ) from None
    stored = expert_quantization_of(hf, path)
    if stored != "none" and "expert_quantization" not in overrides:  # the model the file holds
        dtypes = {name: dtype for name, (_, dtype) in tensor_shapes(directory).items()}
        cfg = dataclasses.replace(cfg, expert_quantization=computed_quantization(stored, dtypes))
        cfg.validate()
    # generation_config.json may hold the full EOS list where config.json has one id
    generation = Path(directory) / "generation_config.json"
    if not cfg.eos_token_ids and "eos_token_ids" not in overrides and os.path.lexists(generation):
        eos = read_json(generation, "the generation config").get("eos_token_id")
        try:
            listed = token_id_list(eos)
        except (TypeError, ValueError):
            raise ConversionError(
                f"{generation}: eos_token_id {eos!r} is not a token id or a list of them"
            ) from None
        if listed:
            cfg = dataclasses.replace(cfg, eos_token_ids=listed)
            cfg.validate()
    return cfg


def load_hf_directory(directory: str | Path, **overrides: Any) -> tuple[ModelConfig, dict[str, Any]]:
    """Read an HF ``save_pretrained`` directory (new or legacy layout) -> (ModelConfig, variables)."""
    cfg = hf_directory_model(directory, **overrides)
    tensors = read_directory(directory)
    stored = expert_quantization_of(read_hf_config(directory), Path(directory) / "config.json")
    if stored == "none":
        check_unquantized(tensors, directory)
    else:
        tensors = dequantize_experts(tensors, stored, directory)
    if is_legacy_layout(tensors):
        tensors = legacy_to_hf(tensors, cfg.num_layers)
    _warn_unanchored_skip_biases(directory, tensors)
    return cfg, hf_to_variables(tensors, cfg)


def _warn_unanchored_skip_biases(directory: str | Path, tensors: Mapping[str, np.ndarray]) -> None:
    """One warning when a file's skip-class biases are not -1: zaya reads them as written, but
    ``transformers`` sets them to -1 after loading, so the two run such a file with different
    routing (a file ``zaya convert zaya-to-hf`` writes is anchored, :func:`anchor_skip_bias`)."""
    skips = [float(v[-1]) for name, v in tensors.items() if name.endswith("balancing_biases")]
    moved = [x for x in skips if x != HF_SKIP_BIAS]
    if moved:
        warnings.warn(
            f"{directory}: {len(moved)} of {len(skips)} layers have a skip-class balancing bias other than "
            f"{HF_SKIP_BIAS:g} (e.g. {moved[0]:.6g}); zaya uses the file's values, but transformers' "
            f"from_pretrained resets them to {HF_SKIP_BIAS:g}, so transformers routes this directory "
            "differently; zaya convert zaya-to-hf of the converted run writes a directory both read alike",
            stacklevel=3,
        )


HF_SKIP_BIAS = -1.0
"""The skip class's balancing bias as ``transformers`` 5.24 loads it: ``from_pretrained`` re-runs the
router's init on that one value after reading the file, whatever the file holds."""


def _exported_quantization(cfg: ModelConfig, quantize: str | None) -> str:
    """The ``model.expert_quantization`` an export with ``quantize`` stores (see save_hf_directory)."""
    own = next((k for k, v in KINDS.items() if v == cfg.expert_quantization), "none")
    quantize = own if quantize is None else quantize
    if quantize != "none" and quantize not in KINDS:
        raise ConversionError(f"quantize {quantize!r} is not one of none, {', '.join(KINDS)}")
    expert_quantization = KINDS.get(quantize, "none")
    try:  # MXFP4's widths, before anything is written
        dataclasses.replace(cfg, expert_quantization=expert_quantization).validate()
    except ConfigError as err:
        raise ConversionError(f"quantize {quantize!r}: {err}") from None
    if cfg.expert_quantization not in ("none", expert_quantization):
        raise ConversionError(
            f"the model reads its experts as {cfg.expert_quantization} (model.expert_quantization), "
            f"so an export with quantize {quantize!r} would not be the model it computes; export it with "
            f"quantize {own!r}"
        )
    return expert_quantization


def anchor_skip_bias(biases: np.ndarray) -> np.ndarray:
    """biases: (..., E+1) balancing biases, the skip class last -> float32 biases of the same shape,
    each row shifted by one constant so that its skip class's bias is exactly ``HF_SKIP_BIAS``.

    The biases only select a class (argmax of p + b, spec §2.4), so a common shift leaves the model
    as it was: the same selections (up to float32 rounding of classes within an ulp of a tie) and the
    same logits. ``transformers`` then loads the file as written. A row whose skip bias is already
    -1 is returned bit for bit.
    """
    wide = np.asarray(biases, np.float64)
    # float64 keeps the skip class's difference exact; each bias is rounded once, to float32
    return (wide - (wide[..., -1:] - HF_SKIP_BIAS)).astype(np.float32)


def save_hf_directory(
    directory: str | Path,
    cfg: ModelConfig,
    variables: Mapping[str, Any],
    dtype: str = "float32",
    max_shard_bytes: int = SHARD_BYTES,
    quantize: str | None = None,
) -> Path:
    """Write a ``save_pretrained``-compatible directory: config.json, generation_config.json (the
    special ids; generation stops on every id of the EOS list) and the weights (tied head omitted)
    as model.safetensors, or shards of at most ``max_shard_bytes`` with model.safetensors.index.json.
    Every file is written atomically and config.json last, so an interrupted write never leaves a
    directory that looks complete; ``zaya convert`` (:func:`zaya_jax.lm.export_hf`) also builds the
    whole directory beside its destination and renames it into place.

    Each layer's balancing biases are written shifted by one constant so that the skip class's is
    -1 (:func:`anchor_skip_bias`): ``transformers`` sets that bias to -1 after loading, so a file
    holding a trained value would route differently once loaded. The export is the same model as
    ``variables``. Read back (``zaya convert hf-to-zaya``, :func:`zaya_jax.load`, ``train.init_from``),
    its biases differ from ``variables``' by that per-layer constant and select the same classes; the
    balancing controller of a run started from it moves and clamps the biases relative to where they
    started (:mod:`zaya_jax.model.balancing`), so it trains as from ``variables``.

    ``quantize`` (``fp8-experts``, ``mxfp4-experts``) stores the experts in that compressed-tensors
    format (:mod:`zaya_jax.interop.hf.quantized`), quantized from ``variables``' own values, and every
    other tensor in ``dtype``; None: the format the model reads its experts in
    (``model.expert_quantization``). A model that reads them quantized is refused another format
    (``none`` included): its float experts are not the model it computes.

    ``transformers`` implements only the ``zero`` MOD-skip semantics, so ``scaled_input`` models are refused.
    """
    if cfg.mod_skip_output != "zero":
        raise ConversionError(
            f"model.mod_skip_output={cfg.mod_skip_output!r} has no Hugging Face equivalent (HF zeroes "
            "skip-routed tokens); only 'zero' models can be exported"
        )
    if dtype not in ("float32", "bfloat16"):
        raise ConversionError(f"dtype {dtype!r} is not supported; use float32 or bfloat16")
    expert_quantization = _exported_quantization(cfg, quantize)
    if has_adapters(variables["params"]):
        raise ConversionError(
            "the parameters carry LoRA adapters, which an HF model has no place for: merge them first "
            "(zaya convert zaya-to-hf RUN OUT --merge) or export them as a PEFT adapter (--adapter)"
        )
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not empty; choose a new destination")
    directory.mkdir(parents=True, exist_ok=True)
    numpy_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {
        name: anchor_skip_bias(value)
        if name.endswith("balancing_biases")
        else value.astype(np.float32 if is_expert(name) and expert_quantization != "none" else numpy_dtype)
        for name, value in variables_to_hf(variables, cfg).items()
    }
    if expert_quantization != "none":  # from the float32 values: not rounded to dtype first
        tensors = compress_experts(tensors, expert_quantization)
    write_directory(directory, tensors, max_shard_bytes)
    generation = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": hf_eos(cfg),
        "pad_token_id": cfg.pad_token_id,
    }
    write_atomic(directory / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    config = {
        "architectures": ["ZayaForCausalLM"],
        "model_type": "zaya",
        "dtype": dtype,
        **model_to_hf_config(cfg),
    }
    if expert_quantization != "none":
        config["quantization_config"] = quantization_config(expert_quantization)
    # Last: a directory with config.json holds every file (transformers and zaya_jax.load look for it).
    write_atomic(directory / "config.json", json.dumps(config, indent=2) + "\n")
    return directory
