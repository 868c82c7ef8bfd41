"""The contract every objective's loss meets, and the held-out evaluation step built on it.

An objective's loss is ``(model, params, balancing, batch) -> (summed loss, stats)``: the loss is a
sum over the batch (never a mean), so micro-batches accumulate to the gradient of the whole batch;
``stats["weight"]`` is what the sum is over (trained tokens for ``lm``, pairs for the preference
objectives, completion tokens for ``grpo``) and the step divides the gradient and every entry of
``stats["sums"]`` by it; ``stats["tokens"]`` counts the trained tokens; the routing statistics
(:func:`~zaya_jax.loss.forward.routing_stats`) feed the balancing controller. Held-out evaluation
runs the same function (:func:`make_eval_step`) and reports ``eval_metrics`` of the sums.

Which loss a run trains is not chosen here: each objective's spec (:mod:`zaya_jax.objectives`)
binds one of this package's losses into an :class:`Objective`, and the run's programs
(:func:`zaya_jax.programs.build_programs`) take that binding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np

from zaya_jax.config import Config
from zaya_jax.loss.forward import Batch, under_axis_rules
from zaya_jax.model import Zaya
from zaya_jax.model.mesh_hooks import SINGLE_DEVICE, ModelHooks

LossFn = Callable[[Zaya, dict[str, Any], dict[str, Any], Batch], tuple[jax.Array, dict[str, Any]]]
FieldSpec = tuple[type[np.generic], tuple[int, ...]]  # dtype, shape after (rows, seq)


@dataclasses.dataclass(frozen=True)
class MetricBound:
    """The largest value one of an objective's step metrics (a name in ``stats["sums"]``, per unit
    of the weight) may take: past it the train step keeps its previous state, and the run skips the
    batch or stops (``resilience.on_metric_bound``, :func:`zaya_jax.train.decisions.decide`).
    ``setting`` is the config key holding ``limit``; ``meaning`` says what a value past it tells."""

    metric: str
    limit: float
    setting: str
    meaning: str


@dataclasses.dataclass(frozen=True)
class Objective:
    """One objective's loss with its settings bound: ``loss_and_stats``, the sums held-out
    evaluation reports (each ``eval_<name>`` in ``metrics.jsonl``; ``loss`` is ``eval_loss``), the
    batch fields it adds to the text fields (:data:`zaya_jax.data.BATCH_FIELDS`), what
    ``stats["weight"]`` counts (``tokens``: a held-out report has a perplexity; ``pairs``: not),
    and the bounds its step metrics are held to (:class:`MetricBound`)."""

    name: str
    loss_and_stats: LossFn
    eval_metrics: tuple[str, ...] = ("loss",)
    fields: Mapping[str, FieldSpec] = dataclasses.field(default_factory=dict)
    unit: Literal["tokens", "pairs"] = "tokens"
    bounds: tuple[MetricBound, ...] = ()


ObjectiveFor = Callable[[Config], Objective]  # an objective's binding: settings in, loss out


def make_eval_step(
    cfg: Config,
    objective: ObjectiveFor,
    hooks: ModelHooks = SINGLE_DEVICE,
    axis_rules: tuple[jax.sharding.Mesh, Sequence[tuple[str, Any]]] | None = None,
) -> Callable[[dict[str, Any], dict[str, Any], Batch], dict[str, jax.Array]]:
    """(params, balancing, batch) -> ``{"weight", **sums}`` of the objective's ``eval_metrics``
    (bound without the z-loss: the held-out number is the training number's cross-entropy);
    arguments as :func:`zaya_jax.programs.step.make_train_step`'s."""
    bound = objective(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, z_loss=0.0)))
    model = Zaya(cfg.model, hooks)

    def evaluate(params: dict[str, Any], balancing: dict[str, Any], batch: Batch) -> dict[str, jax.Array]:
        _, stats = bound.loss_and_stats(model, params, balancing, batch)
        return {"weight": stats["weight"], **{k: stats["sums"][k] for k in bound.eval_metrics}}

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
