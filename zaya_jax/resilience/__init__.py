"""Keeping long runs alive: the in-trainer watchdog and heartbeat, the loss guard (non-finite and
spiking losses), fault injection for tests, and ``zaya supervise`` (restart with backoff)."""

from zaya_jax.resilience.faults import Faults, corrupt_checkpoint
from zaya_jax.resilience.guard import LossGuard, NonFiniteLossError, classify_runtime_error
from zaya_jax.resilience.watchdog import EXIT_HANG, HANG_STACKS, HEARTBEAT, Watchdog

__all__ = [
    "EXIT_HANG",
    "HANG_STACKS",
    "HEARTBEAT",
    "Faults",
    "LossGuard",
    "NonFiniteLossError",
    "Watchdog",
    "classify_runtime_error",
    "corrupt_checkpoint",
]
