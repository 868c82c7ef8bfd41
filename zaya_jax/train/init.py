"""Starting a run from existing weights (``train.init_from``): a run directory, a step directory or
a Hugging Face ``save_pretrained`` directory (converted in memory).

Parameters and balancing biases are loaded into the fresh run's state, placed directly in its
shardings; the optimizer, the step count, the balancing controller's integrator and the data
position start fresh. The host holds one full copy of the source while it is placed (ZAYA1-8B in
float32: ~35 GB of host memory per process).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from zaya_jax.config import Config, ConfigError, ModelConfig
from zaya_jax.lora.plan import EVERY_PARAMETER, ParameterPlan
from zaya_jax.model.balancing import init_controller
from zaya_jax.pretrained import load_model, read_model

if TYPE_CHECKING:
    from zaya_jax.programs import TrainState


def source_model_config(path: str | Path) -> ModelConfig:
    """The model config of ``train.init_from`` (read without loading any array). A quantized
    export's ``expert_quantization`` is how it stores its experts, not what a run of them computes:
    it is left out (``none``; a run sets ``model.expert_quantization`` to train against it). A zaya
    run's own setting (trained against quantized experts) is kept."""
    files = read_model(_given(path))
    if files.format != "hf":  # a zaya run's setting is what it computes (quantization-aware training)
        return files.model
    return dataclasses.replace(files.model, expert_quantization="none")


def check_source(cfg: Config) -> None:
    """A quantized export as ``train.init_from`` is refused unless ``train.init_dequantized``."""
    if not cfg.train.init_from or cfg.train.init_dequantized or not os.path.lexists(cfg.train.init_from):
        return  # (a missing source is named where it is read: a resumed run reads none)
    files = read_model(Path(cfg.train.init_from))
    stored = files.model.expert_quantization
    if files.format == "hf" and stored != "none":
        raise ConfigError(
            f"train.init_from={cfg.train.init_from} holds its experts quantized ({stored}): training from it "
            "would start from their rounding; set train.init_dequantized=true to start from the dequantized "
            "experts, or start from the unquantized model"
        )


def _given(path: str | Path) -> Path:
    if not os.path.lexists(path):
        raise FileNotFoundError(f"train.init_from={path} does not exist; give a run, step or HF directory")
    return Path(path)


def _load_source(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(variables on the host, what was loaded: for the run's events)."""
    files = load_model(_given(path))
    return files.variables, files.origin()


def _shapes(tree: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {
        jax.tree_util.keystr(path): tuple(np.shape(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def check_fits(source: dict[str, Any], target: dict[str, Any], origin: str) -> None:
    """A clear error naming the leaves where the source weights and the model config disagree."""
    ours, theirs = _shapes(target), _shapes(source)
    names = sorted(ours.keys() | theirs.keys(), key=lambda name: (not name.startswith("['params']"), name))
    wrong = [
        f"{name} is {theirs.get(name, 'absent')} in the source but {ours.get(name, 'absent')} with this config"
        for name in names
        if ours.get(name) != theirs.get(name)
    ]
    if wrong:
        more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
        raise ConfigError(
            f"train.init_from={origin}: the weights do not fit the model config: {'; '.join(wrong[:4])}{more}. "
            "The model config is taken from the source; drop the model.* override that changes these leaves"
        )


def _place(source: Any, like: Any) -> Any:
    """``source`` (host or single-device arrays) as global arrays in ``like``'s shardings and dtypes."""

    def place(value: np.ndarray | jax.Array, target: jax.Array) -> jax.Array:
        host = np.asarray(value).astype(target.dtype)
        return jax.make_array_from_callback(host.shape, target.sharding, lambda index: host[index])

    return jax.tree.map(place, source, like)


def initialize_from(
    path: str | Path, state: TrainState, parameters: ParameterPlan = EVERY_PARAMETER
) -> tuple[TrainState, dict[str, Any]]:
    """``state`` (a fresh TrainState) with the parameters and balancing biases of ``path``; returns
    it and a description of the source for the run's ``init_from`` event. With a frozen base
    (``parameters``) the state keeps its fresh adapters and takes the source as its base (in the
    state's dtypes, the base dtype); a source with adapters of the run's rank, targets and scale (a
    PEFT directory, a LoRA run) gives its base and continues its adapters, one with others is merged
    into the base (:meth:`~zaya_jax.lora.plan.ParameterPlan.arranged`). A run that trains every
    parameter starts from such a source merged."""
    path = Path(path)
    variables, described = _load_source(path)
    params = parameters.arranged(variables["params"], state.params)
    target = {"params": state.params, "balancing": state.balancing}
    source = {"params": params, "balancing": variables["balancing"]}
    check_fits(source, target, str(path))
    placed = _place(source, target)
    controller = init_controller(np.asarray(source["balancing"]["layers"]["router"]["biases"], np.float32))
    state = state.replace(
        params=placed["params"],
        balancing=placed["balancing"],
        controller=_place(controller, state.controller),
    )
    return state, described


def starting_weights(
    cfg: Config, fresh: TrainState, parameters: ParameterPlan = EVERY_PARAMETER
) -> TrainState:
    """The weights a run of ``cfg`` started from: ``train.init_from``'s placed into ``fresh`` (the
    initialisation of ``train.seed``), or ``fresh`` itself. A resumed run recomputing lost reference
    scores and ``zaya eval RUN --data PAIRS`` take them from here."""
    return initialize_from(cfg.train.init_from, fresh, parameters)[0] if cfg.train.init_from else fresh
