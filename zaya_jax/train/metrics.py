"""Where training metrics go: ``metrics.jsonl`` (one JSON object per line, each with ``step``),
TensorBoard event files (``tb/``), ``events.jsonl`` for run events, and a progress bar."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Append-only metric sinks of one run directory. Lines are flushed as written, so a crash
    loses nothing already logged."""

    def __init__(self, run_dir: str | Path, progress_total: int | None = None, enabled: bool = True):
        from tensorboardX import SummaryWriter

        self.enabled = enabled  # False on every process but the first of a multi-process run
        self.run_dir = Path(run_dir)
        self._step = 0
        if not enabled:
            return
        self._metrics = (self.run_dir / "metrics.jsonl").open("a")
        self._events = (self.run_dir / "events.jsonl").open("a")
        self._tb = SummaryWriter(str(self.run_dir / "tb"))
        self._bar = tqdm(total=progress_total, unit="step", dynamic_ncols=True) if progress_total else None

    def write(self, record: dict[str, Any]) -> None:
        """One metrics line; numeric fields also go to TensorBoard under their names."""
        if not self.enabled:
            return
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()
        step = int(record["step"])
        self._step = step
        for key, value in clean.items():
            if key != "step" and isinstance(value, int | float) and value is not None:
                self._tb.add_scalar(key, value, step)
            elif isinstance(value, list) and all(isinstance(v, int | float) for v in value):
                for i, v in enumerate(value):
                    self._tb.add_scalar(f"{key}/{i}", v, step)

    def event(self, detail: dict[str, Any]) -> None:
        """A run event in ``events.jsonl``: ``{"time", "event", "step", "detail"}``."""
        if not self.enabled:
            return
        detail = dict(detail)
        line = {"time": time.time(), "event": detail.pop("event"), "step": self._step, "detail": detail}
        self._events.write(json.dumps(line, default=str) + "\n")
        self._events.flush()

    def advance(self, last: dict[str, Any]) -> None:
        if not self.enabled or self._bar is None:
            return
        self._bar.update(1)
        if last:
            self._bar.set_postfix(
                loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}", refresh=False
            )

    def rewind(self, step: int) -> None:
        """Drop metric lines after ``step`` (a rollback re-runs those step numbers), atomically."""
        if not self.enabled:
            return
        self._metrics.close()
        path = self.run_dir / "metrics.jsonl"
        kept = [
            line
            for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step
        ]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
        self._metrics = path.open("a")

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._tb.close()
        self._metrics.close()
        self._events.close()
