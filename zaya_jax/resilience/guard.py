"""The loss guard: the largest loss the next step may report before its update is rejected.

The jitted step skips its own update (keeps the previous parameters and optimizer state) when the
loss or gradient norm is not finite or the loss exceeds this limit; the limit is a robust z-score
bound over recent accepted losses: median + z · 1.4826 · MAD (MAD floored at 1e-3 · |median|, so
a perfectly flat history does not flag noise)."""

from __future__ import annotations

import collections
import math

import numpy as np

from zaya_jax.config import ResilienceConfig


class NonFiniteLossError(RuntimeError):
    """A non-finite loss or gradient with ``resilience.on_nonfinite=stop``, or too many rollbacks."""


class LossGuard:
    def __init__(self, cfg: ResilienceConfig):
        self.cfg = cfg
        self.history: collections.deque[float] = collections.deque(maxlen=cfg.spike_window)

    def limit(self) -> float:
        if self.cfg.on_spike == "none" or len(self.history) < self.cfg.spike_warmup:
            return math.inf
        values = np.asarray(self.history)
        median = float(np.median(values))
        mad = max(float(np.median(np.abs(values - median))), 1e-3 * abs(median), 1e-12)
        return median + self.cfg.spike_zscore * 1.4826 * mad

    def accept(self, loss: float) -> None:
        self.history.append(loss)


def classify_runtime_error(err: BaseException) -> str:
    """A coarse class for an XLA/runtime error message, for events and the supervisor's log."""
    text = str(err).lower()
    rules = [
        ("out_of_memory", ("resource_exhausted", "out of memory", "oom")),
        ("collective_timeout", ("deadline_exceeded", "timed out", "timeout")),
        ("hardware", ("ecc", "uncorrectable", "xid", "hardware")),
        ("communication", ("nccl", "rccl", "gloo", "connection reset", "unavailable", "barrier")),
    ]
    for name, needles in rules:
        if any(n in text for n in needles):
            return name
    return "runtime"
