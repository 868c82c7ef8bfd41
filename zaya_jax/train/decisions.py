"""What the loop decides after a step: accept it, skip it, roll back to the last checkpoint, or stop,
for its loss (:func:`decide`) and for a routing-health alarm (:func:`decide_routing`).

A pure function of the step's outcome, the ``resilience.*`` settings and the rollbacks so far, so
the loop acts on a returned :class:`Decision` and no state changes hands through closures.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax

from zaya_jax.config import ResilienceConfig
from zaya_jax.resilience.routing import RoutingAlarm


class Action(enum.Enum):
    ACCEPT = "accept"  # the update stands
    SKIP = "skip"  # the step kept its previous state (the jitted step already did so)
    ROLLBACK = "rollback"  # restore the last checkpoint; the data stream goes on
    STOP = "stop"  # raise NonFiniteLossError (RoutingAlarmError for a routing alarm)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one step reported: its loss, whether its update was kept and why not."""

    step: int
    loss: float
    skipped: bool
    nonfinite: bool
    limit: float  # the loss limit the step ran under
    routing: bool = False  # the step undid itself for its routing (on_routing_alarm: skip)

    @staticmethod
    def prefetch(metrics: dict[str, Any]) -> None:
        """Start copying the values :meth:`of` reads to the host as soon as the step computes them."""
        for name in ("skipped", "nonfinite", "loss", "routing_rejected"):
            if isinstance(metrics.get(name), jax.Array):
                metrics[name].copy_to_host_async()

    @classmethod
    def of(cls, step: int, metrics: dict[str, Any], limit: float) -> Outcome:
        skipped, nonfinite, loss, routing = (float(x) for x in jax.device_get(
            (metrics["skipped"], metrics["nonfinite"], metrics["loss"], metrics.get("routing_rejected", 0.0))
        ))  # fmt: skip
        return cls(step, loss, bool(skipped), bool(nonfinite), limit, bool(routing))

    @property
    def reason(self) -> str:
        if self.nonfinite:
            return "nonfinite"
        return "routing" if self.routing and not self.loss > self.limit else "spike"


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    message: str = ""  # for STOP: the error to raise
    reason: str = ""  # for ROLLBACK: what it is for (default: the outcome's)


def decide(outcome: Outcome, cfg: ResilienceConfig, rollbacks: int) -> Decision:
    """The action for ``outcome`` under ``cfg`` (``on_nonfinite``, ``on_spike``, ``max_rollbacks``),
    ``rollbacks`` having been made already in this run."""
    if not outcome.skipped:
        return Decision(Action.ACCEPT)
    if outcome.reason == "routing":  # on_routing_alarm: skip, already done inside the step
        return Decision(Action.SKIP)
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
