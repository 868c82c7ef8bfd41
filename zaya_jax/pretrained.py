"""One loading path for model files: a run directory (its latest readable step), a step directory
(``checkpoints/<step>``), a Hugging Face ``save_pretrained`` directory or an HF PEFT LoRA adapter
directory (its ``base_model_name_or_path`` loaded, the adapters on it), for everything that uses a
trained model: ``zaya_jax.load`` (and through it ``zaya eval``, ``zaya generate``, ``zaya convert
zaya-to-hf`` and the lm-eval model), ``train.init_from`` and ``zaya inspect``.

Checkpoints are read through :mod:`zaya_jax.checkpoint.readable` (a damaged step of a run set aside
and the previous one used; an explicit damaged step an error naming it), HF directories through
:mod:`zaya_jax.interop.hf` and the tokenizer beside them through :mod:`zaya_jax.data.tokenizers`;
every file that cannot be read is an error naming it and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from zaya_jax import checkpoint
from zaya_jax.checkpoint.base import check_base
from zaya_jax.checkpoint.fingerprint import digest
from zaya_jax.checkpoint.readable import locate
from zaya_jax.config import Config, ModelConfig, to_dict
from zaya_jax.data.sources import DataError
from zaya_jax.data.tokenizers import HFTokenizer, Tokenizer, load_tokenizer, special_tokens
from zaya_jax.files import read_json
from zaya_jax.interop.hf import hf_directory_model, is_hf_directory, load_hf_directory
from zaya_jax.interop.safetensors_io import tensor_shapes
from zaya_jax.lora.peft import CONFIG_FILE as PEFT_CONFIG
from zaya_jax.lora.peft import peft_params
from zaya_jax.lora.plan import parameter_plan
from zaya_jax.model import param_counts
from zaya_jax.model.lowrank import adapter_part, join


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """What a path holds: its ``format`` (``zaya``, ``hf`` or ``peft``), the model config, for a checkpoint the
    run's whole config and the step read, and the variables (None when only the config was read)."""

    path: Path
    format: str
    model: ModelConfig
    run: Config | None = None
    step: int | None = None
    variables: dict[str, Any] | None = None

    def origin(self) -> dict[str, Any]:
        """What was loaded, for a run's events."""
        return {
            "source": str(self.path),
            "format": self.format,
            **({"step": self.step} if self.step is not None else {}),
        }


def model_format(path: str | Path) -> str:
    """``hf`` for a ``save_pretrained`` directory, ``zaya`` for anything else that exists (a run or a
    step directory; reading it says what is wrong with it)."""
    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"{path} does not exist; give a run directory, a step directory ({checkpoint.CHECKPOINTS}/<step>) "
            "or a Hugging Face save_pretrained directory"
        )
    if is_peft_directory(path):
        return "peft"
    return "hf" if is_hf_directory(path) else "zaya"


def _peft_base(path: Path) -> Path:
    """The base model a PEFT adapter directory names (``base_model_name_or_path``, a local path:
    absolute, or relative to the adapter directory or the working directory)."""
    config = read_json(path / PEFT_CONFIG, "a PEFT adapter config")
    named = config.get("base_model_name_or_path")
    if not named:
        raise FileNotFoundError(
            f"{path / PEFT_CONFIG} names no base_model_name_or_path; set it to the base model's local HF or "
            "zaya-jax directory (a PEFT adapter is loaded onto its base)"
        )
    for candidate in (Path(named), path / named):
        if os.path.lexists(candidate):
            return candidate
    raise FileNotFoundError(
        f"{path / PEFT_CONFIG}: base_model_name_or_path={named!r} is not a local directory; download the base "
        "model and set the key to its path"
    )


def _peft_model(path: Path) -> ModelFiles:
    """A PEFT adapter directory: its base loaded (without adapters of its own) and its adapters on it."""
    base = load_model(_peft_base(path))
    params = peft_params(path, base.variables["params"], base.model)
    return ModelFiles(path, "peft", base.model, variables={**base.variables, "params": params})


def read_model(path: str | Path) -> ModelFiles:
    """The model config (and a checkpoint's run config and step) without reading any array."""
    path = Path(path)
    kind = model_format(path)
    if kind == "peft":
        return ModelFiles(path, "peft", read_model(_peft_base(path)).model)
    if kind == "hf":
        return ModelFiles(path, "hf", hf_directory_model(path))
    cfg, step = checkpoint.read_config(path)
    return ModelFiles(path, "zaya", cfg.model, cfg, step)


def load_model(path: str | Path) -> ModelFiles:
    """The model config and variables (a checkpoint's on the first local device, an HF directory's
    on the host), every checkpoint array checked against its fingerprint."""
    path = Path(path)
    kind = model_format(path)
    if kind == "peft":
        return _peft_model(path)
    if kind == "hf":
        model, variables = load_hf_directory(path)
        return ModelFiles(path, "hf", model, variables=variables)
    run, variables, step = checkpoint.restore_model(path)
    if parameter_plan(run).frozen_base:
        variables = _with_base(run, variables, step, path)
    return ModelFiles(path, "zaya", run.model, run, step, variables)


def _with_base(run: Config, variables: dict[str, Any], step: int, path: Path) -> dict[str, Any]:
    """A step's adapters on their frozen base: ``train.init_from``'s, as the run took it and held it
    (:meth:`~zaya_jax.lora.plan.ParameterPlan.base_from`), checked against the step's base record."""
    step_dir = locate(path)[0] / str(step)
    try:
        source = load_model(run.train.init_from)
    except (FileNotFoundError, checkpoint.CheckpointNotFoundError) as err:
        raise checkpoint.CheckpointNotFoundError(
            f"{step_dir} holds LoRA adapters; their base model train.init_from={run.train.init_from} "
            f"cannot be loaded ({err}). Put the base weights back at that path"
        ) from err
    base = parameter_plan(run).base_from(source.variables["params"], variables["params"])
    check_base(step_dir, digest({"params": base}))
    return {**variables, "params": join(adapter_part(variables["params"]), base)}


def is_peft_directory(path: str | Path) -> bool:
    return (Path(path) / PEFT_CONFIG).is_file()


def describe_model(path: str | Path) -> dict[str, Any]:
    """``zaya inspect``'s report from metadata alone: format, config, step, parameter counts and
    every array's (shape, dtype)."""
    path = Path(path)
    if model_format(path) == "peft":
        base = _peft_base(path)
        return {
            **describe_model(base),
            "format": "peft",
            "base": str(base),
            "adapter": read_json(path / PEFT_CONFIG, "a PEFT adapter config"),
        }
    if model_format(path) == "hf":
        model = hf_directory_model(path)
        arrays = {"tensors": tensor_shapes(path)}
        return {"format": "hf", "config": {"model": to_dict(model)}, **param_counts(model), "arrays": arrays}
    cfg, step, arrays = checkpoint.describe(path)
    return {
        "format": "zaya",
        "step": step,
        "config": to_dict(cfg),
        **param_counts(cfg.model),
        "arrays": arrays,
    }


def find_tokenizer(path: str | Path, run: Config | None) -> tuple[Tokenizer | None, str | None]:
    """(tokenizer, why there is none). A run's tokenizer is its ``data.tokenizer`` (one that cannot
    be loaded, say on another machine, leaves None and the reason: the weights stay usable); an HF
    directory's is its ``tokenizer.json`` with the special tokens its settings name, and a damaged
    one is an error naming the file."""
    if run is not None:
        try:
            return load_tokenizer(run.data.tokenizer), None
        except (DataError, OSError) as err:
            return None, f"the run's tokenizer {run.data.tokenizer!r} cannot be loaded ({err})"
    path = Path(path)
    if not os.path.lexists(path / "tokenizer.json"):
        return None, f"{path / 'tokenizer.json'} is missing"
    names = special_tokens(path)
    wanted = {key: names[key] for key in ("eos_token", "pad_token", "bos_token") if key in names}
    return HFTokenizer(path / "tokenizer.json", **wanted), None
