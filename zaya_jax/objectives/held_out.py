"""Held-out evaluation by the objective's own loss: during training (:class:`HeldOut`, every
``eval.every`` steps on the run's mesh) and of a saved model (:func:`evaluate_held_out`, on one
device), both the evaluation program of the run's programs on the same held-out batches, so
``zaya eval`` of a run reproduces its ``eval_loss``. Objectives scored otherwise (GRPO's reward)
bring their own evaluator."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from zaya_jax.config import Config, ConfigError
from zaya_jax.data import load_tokenizer
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.loss import ObjectiveFor, average
from zaya_jax.objectives.spec import Evaluable, RunSetup, SavedRun, spec_for
from zaya_jax.parallel.distributed import barrier
from zaya_jax.programs import TrainState, held_out_host_batches, single_device_programs


class HeldOut:
    """A run's held-out evaluation while it trains: ``eval.batches`` batches of the held-out split,
    placed on the mesh once; calling it returns the objective's held-out metrics (``loss``: the
    mean cross-entropy per target token for ``lm``; per pair, with ``pair_accuracy`` and the
    rewards, for the preference objectives), by the model of the stage in force (its RoPE)."""

    def __init__(self, setup: RunSetup, references: Mapping[str, np.ndarray] | None = None):
        self.programs, self.beat = setup.programs, setup.beat
        self._compiled: dict[Any, jax.stages.Compiled] = {}  # per stage model
        self.batches = setup.programs.held_out_batches(setup.tokenizer, references)

    def __call__(self, step: int, state: TrainState, stage: int = 0) -> dict[str, float]:
        programs = self.programs.at_stage(stage)
        model = programs.cfg.model
        self.beat(step, "eval" if model in self._compiled else "compile")
        if model not in self._compiled:
            lowered = programs.eval_step.lower(state.params, state.balancing, self.batches[0])
            self._compiled[model] = lowered.compile()
            barrier("eval", programs.cfg.runtime.barrier_timeout_s)
        run = self._compiled[model]
        return average(run(state.params, state.balancing, batch) for batch in self.batches)[0]


def checked_tokenizer(tokenizer: Tokenizer | str, model: Evaluable) -> Tokenizer:
    """``tokenizer`` (or its spec, loaded), refused when its ids do not fit the model's vocabulary."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if tok.vocab_size > model.config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary is {model.config.vocab_size}; "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    return tok


def loss_over(
    model: Evaluable,
    cfg: Config,
    objective: ObjectiveFor,
    batches: Iterable[dict[str, np.ndarray]],
    progress: bool = False,
) -> dict[str, Any]:
    """``objective``'s held-out metrics of ``model`` over host ``batches`` on one device, with the
    weight they were averaged over (``tokens`` and ``perplexity``, or ``pairs``)."""
    programs = single_device_programs(cfg, objective)
    params, balancing = model.variables["params"], model.variables["balancing"]
    shown = tqdm(batches, unit="batch", desc="eval", disable=not progress, leave=False)
    eval_step = programs.eval_step
    means, weight = average(eval_step(params, balancing, jax.tree.map(jnp.asarray, b)) for b in shown)
    if weight == 0:
        raise ValueError("no evaluation tokens: the split of the data is empty")
    if programs.bound.unit == "pairs":
        return {**means, "pairs": int(weight)}
    return {**means, "perplexity": math.exp(means["loss"]), "tokens": int(weight)}


def evaluate_held_out(
    model: Evaluable,
    run_config: Config,
    *,
    tokenizer: Tokenizer | str | None = None,
    progress: bool = False,
    references: Mapping[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """The run's own held-out evaluation, as training computes its ``eval_loss``: the same held-out
    batches (``train.seq_len``, ``train.batch_size``, ``eval.batches``, ``train.seed``) and the
    same loss code. Returns ``{"loss", "perplexity", "tokens"}``, or for a preference run
    ``{"loss", "pair_accuracy", ..., "pairs"}`` (``references``: the run's reference
    log-probabilities, dpo and ipo)."""
    tok = checked_tokenizer(tokenizer if tokenizer is not None else run_config.data.tokenizer, model)
    cfg = dataclasses.replace(run_config, model=model.config)
    batches = held_out_host_batches(cfg, tok, references)
    return loss_over(model, cfg, spec_for(cfg).loss, batches, progress)


def describe_held_out(saved: SavedRun) -> str:
    """What :func:`evaluate_held_out` of ``saved`` evaluated, in words."""
    cfg = saved.cfg
    return (
        f"the run's held-out evaluation (step {saved.step}): {cfg.eval.batches} batches of "
        f"{cfg.train.batch_size} x {cfg.train.seq_len} tokens, seed {cfg.train.seed}"
    )


def saved_run_evaluation(
    references: Callable[[SavedRun], Mapping[str, np.ndarray] | None] | None = None,
) -> Callable[[SavedRun], dict]:
    """An ``evaluate_saved`` part for an objective evaluated by its loss (``references(saved)``:
    the batches' reference log-probabilities, read from the run)."""

    def evaluate_saved(saved: SavedRun) -> dict[str, Any]:
        refs = references(saved) if references is not None else None
        result = evaluate_held_out(
            saved.model, saved.cfg, tokenizer=saved.tokenizer, progress=saved.progress, references=refs
        )
        return {**result, "evaluated": describe_held_out(saved)}

    return evaluate_saved
