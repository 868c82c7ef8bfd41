"""Routing health: an alarm when a layer's router degenerates, for pretraining and post-training.

The train step reports per layer (``metrics["routing"]``, :func:`zaya_jax.programs.step.make_train_step`)
each class's share of the tokens, the router's mean entropy over ln(E + 1) and which balancing
biases sit at their clamp. :class:`RoutingMonitor` averages them over the last
``resilience.routing_window`` accepted steps after ``resilience.routing_warmup`` steps of the run
(a fresh router needs a few hundred steps to balance) and, once the window is full, raises a
:class:`RoutingAlarm` naming the first layer and statistic past its limit:

- ``load_ratio``: the largest expert's share over the smallest's (``routing_max_load_ratio``; an
  expert that received no token in the whole window counts as infinite): experts collapsing;
- ``skip_drift``: the skip class's share minus ``balancing.skip_target`` (``routing_max_skip_drift``);
- ``entropy``: the router's normalised entropy (below ``routing_min_entropy``): every token routed
  with certainty, the router no longer hedging (a collapse that load balance alone may not show);
- ``pinned_bias``: a balancing bias at its clamp for the whole window (only while the controller
  runs): the controller cannot move the load any further.

The inputs are replicated values, so every process raises the same alarm at the same step; the
loop acts on it (``resilience.on_routing_alarm``) through the per-step agreement. ``skip`` is
decided inside the step instead (:func:`within_limits`, on the step's own statistics: an update is
only undone before it is kept), and the windowed alarm is then reported as with ``warn``.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import Config


class RoutingAlarmError(RuntimeError):
    """A routing alarm with ``resilience.on_routing_alarm=stop``, or one rollback too many."""


@dataclasses.dataclass(frozen=True)
class RoutingAlarm:
    step: int
    layer: int
    statistic: str  # load_ratio, skip_drift, entropy or pinned_bias
    value: float
    limit: float
    window: int

    @property
    def message(self) -> str:
        return (
            f"step {self.step}: layer {self.layer}'s routing is unhealthy: {self.statistic} = {self.value:.4g} "
            f"(limit {self.limit:g}, mean of the last {self.window} steps)"
        )

    def detail(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "statistic": self.statistic,
            "value": self.value if np.isfinite(self.value) else None,
            "limit": self.limit,
            "window": self.window,
        }


class RoutingMonitor:
    """Windowed per-layer routing statistics; :meth:`add` returns an alarm when a (layer,
    statistic) goes past its limit, once, until it is back within it."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.window: collections.deque[dict[str, np.ndarray]] = collections.deque(
            maxlen=cfg.resilience.routing_window
        )
        self.raised: tuple[int, str] | None = None

    def reset(self) -> None:
        """Forget the window (after a rollback the state it described is gone)."""
        self.window.clear()
        self.raised = None

    def add(self, step: int, routing: dict[str, Any]) -> RoutingAlarm | None:
        """Add one accepted step's ``metrics["routing"]``; the alarm once the window is full."""
        if self.cfg.resilience.on_routing_alarm == "none" or step <= self.cfg.resilience.routing_warmup:
            return None
        self.window.append({k: np.asarray(v, np.float64) for k, v in jax.device_get(routing).items()})
        if len(self.window) < self.window.maxlen:
            return None
        alarm = self._judge(step)
        key = None if alarm is None else (alarm.layer, alarm.statistic)
        fresh = key is not None and key != self.raised
        self.raised = key
        return alarm if fresh else None

    def _judge(self, step: int) -> RoutingAlarm | None:
        res, size = self.cfg.resilience, len(self.window)
        load = np.mean([w["load"] for w in self.window], axis=0)  # (layers, E+1)
        entropy = np.mean([w["entropy"] for w in self.window], axis=0)  # (layers,)
        pinned = np.min([w["pinned"] for w in self.window], axis=0)  # 1 = pinned at every step
        experts = load[:, :-1]
        with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0: a layer whose tokens all skip
            ratio = np.where(experts.min(-1) > 0, experts.max(-1) / experts.min(-1), np.inf)
        drift = np.abs(load[:, -1] - self.cfg.balancing.skip_target)
        checks = [
            ("load_ratio", ratio, res.routing_max_load_ratio, ratio > res.routing_max_load_ratio),
            ("skip_drift", drift, res.routing_max_skip_drift, drift > res.routing_max_skip_drift),
            ("entropy", entropy, res.routing_min_entropy, entropy < res.routing_min_entropy),
        ]
        if self.cfg.balancing.enabled:
            count = pinned.sum(-1)
            checks.append(("pinned_bias", count, 0.0, count > 0))
        for layer in range(load.shape[0]):
            for name, values, limit, bad in checks:
                if bad[layer]:
                    return RoutingAlarm(step, layer, name, float(values[layer]), float(limit), size)
        return None


def within_limits(cfg: Config, routing: dict[str, jax.Array]) -> jax.Array:
    """Inside the step (``on_routing_alarm: skip``): whether this step's own per-layer statistics
    are all within the limits (load ratio, skip drift, entropy; the pinned-bias check needs a
    window), a traced bool."""
    res = cfg.resilience
    load = routing["load"]
    experts = load[:, :-1]
    ratio_ok = experts.max(-1) <= res.routing_max_load_ratio * experts.min(-1)
    drift_ok = jnp.abs(load[:, -1] - cfg.balancing.skip_target) <= res.routing_max_skip_drift
    entropy_ok = routing["entropy"] >= res.routing_min_entropy
    return jnp.all(ratio_ok & drift_ok & entropy_ok)
