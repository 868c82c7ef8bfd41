"""What the loop decides after a step: accept it, skip it, roll back to the last checkpoint, or stop,
for its loss and its objective's bounds (:func:`decide`) and for a routing-health alarm
(:func:`decide_routing`).

A pure function of the step's outcome, the ``resilience.*`` settings and the rollbacks so far, so
the loop acts on a returned :class:`Decision` and no state changes hands through closures.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import numpy as np

from zaya_jax.config import ResilienceConfig
from zaya_jax.loss import MetricBound
from zaya_jax.resilience.routing import RoutingAlarm


class Action(enum.Enum):
    ACCEPT = "accept"  # the update stands
    SKIP = "skip"  # the step kept its previous state (the jitted step already did so)
    ROLLBACK = "rollback"  # restore the last checkpoint; the data stream goes on
    STOP = "stop"  # raise NonFiniteLossError (RoutingAlarmError, MetricBoundError)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one step reported: its loss, whether its update was kept and why not."""

    step: int
    loss: float
    skipped: bool
    nonfinite: bool
    limit: float  # the loss limit the step ran under
    routing: bool = False  # the step undid itself for its routing (on_routing_alarm: skip)
    exceeded: tuple[MetricBound, float] | None = None  # the objective's bound passed, and the value

    @staticmethod
    def prefetch(metrics: dict[str, Any]) -> None:
        """Start copying the values :meth:`of` reads to the host as soon as the step computes them."""
        for name in ("skipped", "nonfinite", "loss", "routing_rejected", "bound_rejected"):
            if isinstance(metrics.get(name), jax.Array):
                metrics[name].copy_to_host_async()

    @classmethod
    def of(
        cls, step: int, metrics: dict[str, Any], limit: float, bounds: tuple[MetricBound, ...] = ()
    ) -> Outcome:
        """``bounds``: the objective's (:attr:`zaya_jax.loss.Objective.bounds`), which the step held
        its metrics to."""
        skipped, nonfinite, loss, routing, bounded = (float(x) for x in jax.device_get(
            (metrics["skipped"], metrics["nonfinite"], metrics["loss"], metrics.get("routing_rejected", 0.0),
             metrics.get("bound_rejected", 0.0))
        ))  # fmt: skip
        exceeded = None
        if bounded:  # compared as the step did, in float32 (NaN is past any bound)
            values = [float(jax.device_get(metrics[b.metric])) for b in bounds]
            past = [
                (b, v)
                for b, v in zip(bounds, values, strict=True)
                if not np.float32(v) <= np.float32(b.limit)
            ]
            exceeded = (past or list(zip(bounds, values, strict=True)))[0]
        return cls(step, loss, bool(skipped), bool(nonfinite), limit, bool(routing), exceeded)

    @property
    def reason(self) -> str:
        if self.nonfinite:
            return "nonfinite"
        if self.exceeded is not None:
            return self.exceeded[0].metric
        return "routing" if self.routing and not self.loss > self.limit else "spike"


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    message: str = ""  # for STOP: the error to raise; for a SKIP past a bound: the user's line
    reason: str = ""  # for ROLLBACK: what it is for (default: the outcome's)


def decide(outcome: Outcome, cfg: ResilienceConfig, rollbacks: int) -> Decision:
    """The action for ``outcome`` under ``cfg`` (``on_nonfinite``, ``on_spike``, ``max_rollbacks``),
    ``rollbacks`` having been made already in this run."""
    if not outcome.skipped:
        return Decision(Action.ACCEPT)
    if outcome.reason == "routing":  # on_routing_alarm: skip, already done inside the step
        return Decision(Action.SKIP)
    if outcome.exceeded is not None and not outcome.nonfinite:
        return decide_bound(outcome.step, *outcome.exceeded, cfg)
    setting = cfg.on_nonfinite if outcome.nonfinite else cfg.on_spike
    if setting == "stop":
        return Decision(
            Action.STOP,
            f"step {outcome.step}: non-finite loss or gradients (loss {outcome.loss}); "
            "resilience.on_nonfinite=stop. Resume from the last checkpoint, or set "
            "resilience.on_nonfinite=skip or rollback",
        )
    if setting == "rollback":
        if rollbacks >= cfg.max_rollbacks:
            return Decision(
                Action.STOP,
                f"step {outcome.step}: {outcome.reason}, and {cfg.max_rollbacks} rollbacks already "
                "(resilience.max_rollbacks); the data or the settings keep producing bad steps",
            )
        return Decision(Action.ROLLBACK)
    return Decision(Action.SKIP)


def decide_bound(step: int, bound: MetricBound, value: float, cfg: ResilienceConfig) -> Decision:
    """A step whose ``bound.metric`` was ``value``, past ``bound.limit`` (``on_metric_bound``): the
    message names the metric, its value, the bound and the settings that change the outcome."""
    what = f"step {step}: {bound.metric} {value:.4g} > {bound.setting}={bound.limit:g} ({bound.meaning})"
    if cfg.on_metric_bound == "stop":
        return Decision(
            Action.STOP,
            f"{what}; resilience.on_metric_bound=stop. Fix the data, raise {bound.setting} (0: off), "
            "or set resilience.on_metric_bound=skip to skip such batches",
        )
    return Decision(
        Action.SKIP,
        f"{what}; the batch is skipped (resilience.on_metric_bound=skip; raise {bound.setting} to train it)",
    )


def decide_routing(alarm: RoutingAlarm, cfg: ResilienceConfig, rollbacks: int) -> Decision:
    """The action for a routing alarm on an otherwise accepted step (``on_routing_alarm``)."""
    setting = cfg.on_routing_alarm
    if setting == "stop":
        return Decision(
            Action.STOP,
            f"{alarm.message}; resilience.on_routing_alarm=stop. Resume from the last checkpoint with "
            "other settings (balancing.*, the learning rates), or set on_routing_alarm to warn or rollback",
        )
    if setting == "rollback":
        if rollbacks >= cfg.max_rollbacks:
            return Decision(
                Action.STOP,
                f"{alarm.message}, and {cfg.max_rollbacks} rollbacks already (resilience.max_rollbacks)",
            )
        return Decision(Action.ROLLBACK, reason=f"routing {alarm.statistic} in layer {alarm.layer}")
    return Decision(Action.ACCEPT)  # warn, or skip (the step undoes itself on its own statistics)
