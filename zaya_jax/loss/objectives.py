"""What the train step minimises, chosen by ``train.objective``, behind one contract.

An objective is ``(model, params, balancing, batch) -> (summed loss, stats)``: the loss is a sum
over the batch (never a mean), so micro-batches accumulate to the gradient of the whole batch;
``stats["weight"]`` is what the sum is over (trained tokens for ``lm``, pairs for the preference
objectives, completion tokens for ``grpo``) and the step divides the gradient and every entry of
``stats["sums"]`` by it; ``stats["tokens"]`` counts the trained tokens; the routing statistics
(:func:`~zaya_jax.loss.forward.routing_stats`) feed the balancing controller. Held-out evaluation
runs the same function (:func:`make_eval_step`) and reports ``eval_metrics`` of the sums.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax

from zaya_jax.config import PREFERENCE_OBJECTIVES, Config
from zaya_jax.loss.forward import Batch, under_axis_rules
from zaya_jax.loss.next_token import loss_and_stats
from zaya_jax.loss.policy import grpo_loss_and_stats
from zaya_jax.loss.preference import preference_loss_and_stats
from zaya_jax.model import Zaya
from zaya_jax.model.hooks import SINGLE_DEVICE, ModelHooks

LossFn = Callable[[Zaya, Any, Any, Batch], tuple[jax.Array, dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Objective:
    """``loss_and_stats`` of ``name`` and the sums held-out evaluation reports (each ``eval_<name>``
    in ``metrics.jsonl``; ``loss`` is ``eval_loss``)."""

    name: str
    loss_and_stats: LossFn
    eval_metrics: tuple[str, ...]


def objective_for(cfg: Config) -> Objective:
    """The objective ``cfg.train.objective`` names, with its settings bound."""
    name = cfg.train.objective
    if name == "lm":
        fn = functools.partial(_lm, z_loss=cfg.train.z_loss, loss_chunk=cfg.train.loss_chunk)
        return Objective(name, fn, ("loss",))
    if name in PREFERENCE_OBJECTIVES:
        fn = functools.partial(preference_loss_and_stats, cfg=cfg)
        metrics = ("loss", "pair_accuracy", "reward_margin", "chosen_logp", "rejected_logp")
        return Objective(name, fn, metrics)
    if name == "grpo":
        return Objective(name, functools.partial(grpo_loss_and_stats, cfg=cfg), ("loss",))
    raise ValueError(f"train.objective={name!r} is unknown")


def _lm(model: Zaya, params: Any, balancing: Any, batch: Batch, *, z_loss: float, loss_chunk: int):
    return loss_and_stats(model, params, balancing, batch, z_loss, loss_chunk)


def make_eval_step(
    cfg: Config,
    hooks: ModelHooks = SINGLE_DEVICE,
    axis_rules: tuple[Any, Any] | None = None,
) -> Callable[[Any, Any, Batch], dict[str, jax.Array]]:
    """(params, balancing, batch) -> ``{"weight", **sums}`` of the objective's ``eval_metrics``
    (without the z-loss: the held-out number is the training number's cross-entropy); arguments
    as :func:`zaya_jax.programs.step.make_train_step`'s."""
    objective = objective_for(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, z_loss=0.0)))
    model = Zaya(cfg.model, hooks)

    def evaluate(params: Any, balancing: Any, batch: Batch) -> dict[str, jax.Array]:
        _, stats = objective.loss_and_stats(model, params, balancing, batch)
        return {"weight": stats["weight"], **{k: stats["sums"][k] for k in objective.eval_metrics}}

    return under_axis_rules(evaluate, axis_rules)


def average(sums: Iterable[dict[str, Any]]) -> tuple[dict[str, float], float]:
    """The eval step's outputs over batches -> (each metric per unit of the summed weight, that
    weight); the weight is 0 when nothing was evaluated."""
    totals: dict[str, float] = {}
    for batch_sums in sums:
        for name, value in batch_sums.items():
            totals[name] = totals.get(name, 0.0) + float(value)
    weight = totals.pop("weight", 0.0)
    return {name: total / max(weight, 1.0) for name, total in totals.items()}, weight
