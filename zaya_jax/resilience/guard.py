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


class MetricBoundError(RuntimeError):
    """A step metric past its objective's bound with ``resilience.on_metric_bound=stop``
    (:class:`zaya_jax.loss.MetricBound`)."""


class LossGuard:
    """The spike limit over the last ``spike_window`` accepted losses. With ``lag`` (the loop's
    ``train.dispatch_ahead``: step t is dispatched before step t-1's loss is read) the limit for
    step t leaves out the losses of steps t-lag .. t-1 whether or not they have been read yet, so
    it does not depend on which steps the loop happened to finish early."""

    def __init__(self, cfg: ResilienceConfig, lag: int = 0):
        self.cfg, self.lag = cfg, lag
        self.history: collections.deque[tuple[int, float]] = collections.deque(maxlen=cfg.spike_window + lag)

    def limit(self, step: int = 0) -> float:
        values = [loss for s, loss in self.history if not step - self.lag <= s < step][
            -self.cfg.spike_window :
        ]
        if self.cfg.on_spike == "none" or len(values) < self.cfg.spike_warmup:
            return math.inf
        values = np.asarray(values)
        median = float(np.median(values))
        mad = max(float(np.median(np.abs(values - median))), 1e-3 * abs(median), 1e-12)
        return median + self.cfg.spike_zscore * 1.4826 * mad

    def accept(self, loss: float, step: int = 0) -> None:
        self.history.append((step, loss))


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
