"""Keeping long runs alive: the in-trainer watchdog and heartbeat, the loss guard (non-finite and
spiking losses), routing health (an alarm when a layer's router collapses), and ``zaya supervise`` (restart with backoff). Fault injection is not here: tests
inject faults through ``train(cfg, hooks=[...])`` (``tests/resilience/faults.py``)."""

from zaya_jax.resilience.guard import LossGuard, MetricBoundError, NonFiniteLossError, classify_runtime_error
from zaya_jax.resilience.routing import RoutingAlarm, RoutingAlarmError, RoutingMonitor
from zaya_jax.resilience.watchdog import EXIT_HANG, HANG_STACKS, HEARTBEAT, Watchdog

__all__ = [
    "EXIT_HANG",
    "HANG_STACKS",
    "HEARTBEAT",
    "LossGuard",
    "MetricBoundError",
    "NonFiniteLossError",
    "RoutingAlarm",
    "RoutingAlarmError",
    "RoutingMonitor",
    "Watchdog",
    "classify_runtime_error",
]
