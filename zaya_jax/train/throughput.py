"""The throughput meter: tokens, model FLOPs and data-wait time since the last metrics record, as
tokens/s and MFU (evaluation time left out)."""

from __future__ import annotations

import math
import time
from typing import Any


class Throughput:
    """Tokens, model FLOPs and data-wait time since the last logged record."""

    def __init__(self, peak_flops: float):
        self.peak = peak_flops
        self.reset()

    def reset(self) -> None:
        self.tokens, self.flops, self.data_wait = 0, 0.0, 0.0
        self.start = time.perf_counter()

    def add(self, tokens: int, flops: float) -> None:
        self.tokens += tokens
        self.flops += flops

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation) out of the interval: tokens/s counts training only."""
        self.start += seconds

    def fields(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.start
        return {
            "tokens_per_s": self.tokens / elapsed,
            "mfu": self.flops / elapsed / self.peak if math.isfinite(self.peak) else None,
            "data_wait_s": self.data_wait,
        }
