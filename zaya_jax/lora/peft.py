"""LoRA adapters (:mod:`zaya_jax.lora`) <-> Hugging Face PEFT adapter directories for ``ZayaForCausalLM``
(``PeftModel.from_pretrained(model, directory)`` with peft >= 0.17, which adapts 3-D parameters).

A directory holds ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``use_rslora``; ``target_modules`` names CCA's five projections, ``target_parameters`` the experts'
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``) and ``adapter_model.safetensors``
(float32), one pair per layer ``i`` under ``base_model.model.model.layers.{i}.``:

- attention, ``self_attn.qkv_proj.{q_proj,k_proj,v_proj_current,v_proj_delayed}`` and
  ``self_attn.o_proj``: ``nn.Linear`` LoRA, ``lora_A.weight`` (r, in) and ``lora_B.weight``
  (out, r), delta ``s * B @ A`` on the (out, in) weight. Ours are ``A`` (in, r) and ``B`` (r, out)
  on the (in, out) kernel, so PEFT's A is our ``A^T`` and its B our ``B^T``.
- experts, ``mlp.experts`` (PEFT ``ParamWrapper``): HF's parameter is (E, d1, d2) (gate_up_proj
  (E, 2I, H), down_proj (E, H, I), each expert our weight transposed); PEFT's ``lora_A.weight`` is
  (E*r, d1) with row ``e*r + k`` (expert-major) and ``lora_B.weight`` is (d2, r*E) with column
  ``k*E + e`` (rank-major), delta ``[e, i, o] = s * sum_k A[e*r+k, i] B[o, k*E+e]``. Since HF's
  d1 is our ``out`` and d2 our ``in``, PEFT's A holds our ``B`` and PEFT's B our ``A``: the names
  swap, and the two use different expert orders.
- the two expert parameters live on one module, so PEFT nests one wrapper in another: the first of
  ``target_parameters`` (gate_up_proj) is the inner one, its tensors under
  ``mlp.experts.base_layer.lora_{A,B}.weight``; down_proj's under ``mlp.experts.lora_{A,B}.weight``.

Embedding adapters are refused (PEFT's embedding LoRA and the tied head are not mapped yet).
:func:`peft_params` puts a directory's adapters on a base model's parameters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from zaya_jax.config import LoraConfig, ModelConfig
from zaya_jax.files import read_json, write_atomic
from zaya_jax.interop.safetensors_io import read_safetensors
from zaya_jax.lora.adapters import attach
from zaya_jax.model import abstract_variables
from zaya_jax.model.lowrank import base_part

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers.{i}."

# Our attention kernel -> the HF module PEFT's target_modules names (and its path in a block).
ATTENTION: dict[str, tuple[str, str]] = {
    "layers/attn/q_proj/kernel": ("q_proj", "self_attn.qkv_proj.q_proj"),
    "layers/attn/k_proj/kernel": ("k_proj", "self_attn.qkv_proj.k_proj"),
    "layers/attn/v_current/kernel": ("v_proj_current", "self_attn.qkv_proj.v_proj_current"),
    "layers/attn/v_delayed/kernel": ("v_proj_delayed", "self_attn.qkv_proj.v_proj_delayed"),
    "layers/attn/o_proj/kernel": ("o_proj", "self_attn.o_proj"),
}
# Our expert weight -> PEFT's target_parameters entry, innermost wrapper first (the order matters).
EXPERTS: dict[str, str] = {
    "layers/experts/wi": "mlp.experts.gate_up_proj",
    "layers/experts/wo": "mlp.experts.down_proj",
}
_ROLE_PATHS = {"attention": tuple(ATTENTION), "experts": tuple(EXPERTS)}


class PeftError(ValueError):
    """An adapter that PEFT's format cannot hold, or a PEFT directory that does not fit the model."""


def _expert_prefix(path: str) -> str:
    # PEFT wraps the experts module once per target parameter, in target_parameters' order.
    depth = len(EXPERTS) - 1 - list(EXPERTS).index(path)
    return "mlp.experts." + "base_layer." * depth


def _weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    params = abstract_variables(cfg)["params"]
    shapes = {}
    for path in (*ATTENTION, *EXPERTS):
        node = params
        for key in path.split("/"):
            node = node[key]
        shapes[path] = tuple(node.shape)
    return shapes


def _to_peft(path: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (A, B) of ours -> PEFT's (lora_A.weight, lora_B.weight)."""
    if path in ATTENTION:  # a (in, r), b (r, out)
        return a.T, b.T
    experts, fan_in, rank = a.shape  # a (E, in, r), b (E, r, out)
    peft_a = b.reshape(experts * rank, b.shape[-1])  # row e*r + k
    peft_b = a.transpose(1, 2, 0).reshape(fan_in, rank * experts)  # column k*E + e
    return peft_a, peft_b


def _from_peft(
    path: str, peft_a: np.ndarray, peft_b: np.ndarray, experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`_to_peft`."""
    if path in ATTENTION:
        return peft_a.T, peft_b.T
    rank = peft_a.shape[0] // experts
    b = peft_a.reshape(experts, rank, peft_a.shape[-1])
    a = peft_b.reshape(peft_b.shape[0], rank, experts).transpose(2, 0, 1)
    return a, b


def _paths(targets: tuple[str, ...]) -> list[str]:
    refused = [role for role in targets if role not in _ROLE_PATHS]
    if refused:
        raise PeftError(
            f"LoRA targets {', '.join(refused)} have no PEFT export yet; "
            f"export adapters on {' and '.join(_ROLE_PATHS)} only"
        )
    return [path for role in targets for path in _ROLE_PATHS[role]]


def save_peft_adapter(
    directory: str | Path,
    model_cfg: ModelConfig,
    adapters: Mapping[str, Mapping[str, Any]],
    lora: LoraConfig,
    base_model: str | None = None,
) -> Path:
    """Write ``adapters`` (path -> {"a": (L, [E,] in, r), "b": (L, [E,] r, out)}) of ``lora`` as a
    PEFT adapter directory for the HF export of ``model_cfg``; the weights file first and
    ``adapter_config.json`` last, each atomically. ``base_model``: the HF directory of the base
    (``base_model_name_or_path``), when there is one."""
    paths = _paths(tuple(lora.targets))
    if set(adapters) != set(paths):
        raise PeftError(
            f"adapters for {', '.join(sorted(adapters))} do not match the targets {', '.join(lora.targets)}"
        )
    shapes = _weight_shapes(model_cfg)
    tensors = {}
    for path in paths:
        a, b = (np.asarray(adapters[path][k], np.float32) for k in ("a", "b"))
        *lead, fan_in, fan_out = shapes[path]
        if a.shape != (*lead, fan_in, lora.rank) or b.shape != (*lead, lora.rank, fan_out):
            raise PeftError(
                f"LoRA factors {a.shape} x {b.shape} do not fit {path} {shapes[path]} at rank {lora.rank}"
            )
        for i in range(model_cfg.num_layers):
            peft_a, peft_b = _to_peft(path, a[i], b[i])
            module = ATTENTION[path][1] + "." if path in ATTENTION else _expert_prefix(path)
            name = _PREFIX.format(i=i) + module
            tensors[name + "lora_A.weight"] = np.ascontiguousarray(peft_a)
            tensors[name + "lora_B.weight"] = np.ascontiguousarray(peft_b)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(directory / WEIGHTS_FILE)
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "use_rslora": bool(lora.rslora),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "init_lora_weights": True,
        "target_modules": [ATTENTION[p][0] for p in paths if p in ATTENTION] or None,
        "target_parameters": [EXPERTS[p] for p in paths if p in EXPERTS] or None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    write_atomic(directory / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return directory


def load_peft_adapter(
    directory: str | Path, model_cfg: ModelConfig
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """The adapters of a PEFT directory written by :func:`save_peft_adapter` (or by PEFT for the
    same targets) and the settings ``{"rank", "alpha", "rslora", "targets"}`` (``LoraConfig(**settings)``).
    Anything the format has that ours cannot hold (DoRA, per-module ranks, other modules) is an error."""
    directory = Path(directory)
    config = read_json(directory / CONFIG_FILE, "a PEFT adapter config")
    if config.get("peft_type") != "LORA":
        raise PeftError(f"{directory / CONFIG_FILE}: peft_type {config.get('peft_type')!r}, not 'LORA'")
    unsupported = [
        key
        for key, plain in (
            ("use_dora", False),
            ("rank_pattern", {}),
            ("alpha_pattern", {}),
            ("lora_bias", False),
        )
        if config.get(key, plain) not in (plain, None)
    ]
    if unsupported or config.get("layers_to_transform") or config.get("modules_to_save"):
        extra = [k for k in ("layers_to_transform", "modules_to_save") if config.get(k)]
        raise PeftError(
            f"{directory / CONFIG_FILE}: {', '.join(unsupported + extra)} cannot be loaded into zaya LoRA"
        )
    modules = set(config.get("target_modules") or [])
    parameters = list(config.get("target_parameters") or [])
    targets = []
    if parameters:
        if parameters != list(EXPERTS.values()):
            raise PeftError(
                f"{directory / CONFIG_FILE}: target_parameters {parameters}; zaya's experts role adapts "
                f"{list(EXPERTS.values())} in that order"
            )
        targets.append("experts")
    if modules:
        if modules != {name for name, _ in ATTENTION.values()}:
            raise PeftError(
                f"{directory / CONFIG_FILE}: target_modules {sorted(modules)}; zaya's attention role adapts "
                f"all of {', '.join(name for name, _ in ATTENTION.values())}"
            )
        targets.append("attention")
    if not targets:
        raise PeftError(f"{directory / CONFIG_FILE}: no target_modules or target_parameters")
    rank = int(config["r"])

    tensors = read_safetensors(directory / WEIGHTS_FILE)
    shapes = _weight_shapes(model_cfg)
    adapters: dict[str, dict[str, np.ndarray]] = {}
    used = set()
    for path in _paths(tuple(targets)):
        per_layer = []
        for i in range(model_cfg.num_layers):
            module = ATTENTION[path][1] + "." if path in ATTENTION else _expert_prefix(path)
            name = _PREFIX.format(i=i) + module
            try:
                peft_a, peft_b = tensors[name + "lora_A.weight"], tensors[name + "lora_B.weight"]
            except KeyError as err:
                raise PeftError(f"{directory / WEIGHTS_FILE}: missing {err.args[0]}") from None
            used |= {name + "lora_A.weight", name + "lora_B.weight"}
            per_layer.append(_from_peft(path, peft_a, peft_b, model_cfg.num_experts))
        a = np.stack([a for a, _ in per_layer])
        b = np.stack([b for _, b in per_layer])
        *lead, fan_in, fan_out = shapes[path]
        if a.shape != (*lead, fan_in, rank) or b.shape != (*lead, rank, fan_out):
            raise PeftError(
                f"{directory / WEIGHTS_FILE}: factors {a.shape} x {b.shape} do not fit {path} {shapes[path]} "
                f"at rank {rank}"
            )
        adapters[path] = {"a": a, "b": b}
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise PeftError(f"{directory / WEIGHTS_FILE}: unexpected tensors {', '.join(unexpected[:8])}")
    settings = {
        "rank": rank,
        "alpha": float(config["lora_alpha"]),
        "rslora": bool(config.get("use_rslora", False)),
        "targets": tuple(targets),
    }
    return adapters, settings


def peft_params(directory: str | Path, base: Mapping[str, Any], model_cfg: ModelConfig) -> dict[str, Any]:
    """A PEFT adapter directory's adapters on the parameters of its base model (``base``, without
    adapters of its own): the adapted model's parameters."""
    adapters, settings = load_peft_adapter(directory, model_cfg)
    return attach(base_part(base), adapters, LoraConfig(**settings))
