"""The metric stream of a run: how a step's outputs become one metrics record
(:func:`metric_record`), and :class:`MetricsWriter`, which sends every record to each tracker
(:mod:`zaya_jax.train.trackers`), run events to ``events.jsonl`` and progress to a bar."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from zaya_jax.config import Config
from zaya_jax.files import EVENTS, event_line
from zaya_jax.train.trackers import DashboardTracker, JsonlTracker, TensorBoardTracker, Tracker

# Step outputs that steer the loop (the loss guard), not metrics of the run.
CONTROL_KEYS = (
    "skipped",
    "nonfinite",
    "routing",
    "routing_rejected",
    "bound_rejected",
)  # read by the loop, not written as metrics


def metric_record(step: int, metrics: dict[str, Any], **host: Any) -> dict[str, Any]:
    """One ``metrics.jsonl`` record: every output of the jitted step under its own name, then the
    host-side fields ``host``; arrays become floats (scalars) or lists rounded to 4 decimals."""
    fields = jax.device_get({k: v for k, v in {**metrics, **host}.items() if k not in CONTROL_KEYS})
    return {"step": step, **{name: _python(value) for name, value in fields.items()}}


def eval_record(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of a held-out evaluation after ``step``: ``eval_`` + each name."""
    return {"step": step, **{f"eval_{k}": v for k, v in metrics.items()}}


def _python(value: Any) -> Any:
    if not isinstance(value, np.ndarray | np.generic):
        return value
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else [round(float(x), 4) for x in value.reshape(-1)]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """The metric and event sinks of one run directory; a no-op on every process but the first."""

    def __init__(
        self,
        run_dir: str | Path,
        progress_total: int | None = None,
        enabled: bool = True,
        resume_step: int = 0,
        cfg: Config | None = None,
    ):
        """``resume_step``: the step a resumed run restarts after (its progress bar starts there and
        TensorBoard drops points logged after it). ``cfg.log.trackers`` choose the trackers beside
        ``metrics.jsonl`` (default: TensorBoard)."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.last: dict[str, Any] = {}  # the latest training record written (the summary's final loss)
        self._step = resume_step
        if not enabled:
            return
        self.trackers: list[Tracker] = [JsonlTracker(self.run_dir / "metrics.jsonl")]
        for name in cfg.log.trackers if cfg is not None else ("tensorboard",):
            if name == "tensorboard":
                self.trackers.append(TensorBoardTracker(self.run_dir / "tb", resume_step))
            else:
                self.trackers.append(DashboardTracker(name, cfg, self.run_dir))
        self._events = (self.run_dir / EVENTS).open("a")
        self._bar = None
        if progress_total:  # not a terminal (a Slurm log): a line every ~2% instead of redrawing
            interactive = sys.stderr.isatty()
            self._bar = tqdm(
                total=progress_total,
                initial=min(resume_step, progress_total),
                unit="step",
                dynamic_ncols=interactive,
                mininterval=0.1 if interactive else 30.0,
                ascii=not interactive,
            )

    def write(self, record: dict[str, Any]) -> None:
        """One metrics record (with its ``step``) to every tracker."""
        if "loss" in record:
            self.last = record
        if not self.enabled:
            return
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._step = int(record["step"])
        for tracker in self.trackers:
            tracker.log(self._step, clean)

    def event(self, name: str, /, **detail: Any) -> None:
        """A run event in ``events.jsonl``: ``{"time", "event": name, "step", "detail"}``."""
        if not self.enabled:
            return
        self._events.write(event_line(name, self._step, detail))
        self._events.flush()

    def notice(self, name: str, message: str, /, **detail: Any) -> None:
        """An event that the user is also told of: ``message`` as one line on stderr (above the
        progress bar), once, by process 0."""
        self.event(name, **detail)
        if not self.enabled:
            return
        line = f"zaya train: {message}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def advance(self) -> None:
        """One step done: the progress bar moves, showing the latest record's loss and tokens/s."""
        if not self.enabled or self._bar is None:
            return
        self._bar.update(1)
        if self.last:
            self._bar.set_postfix(
                loss=f"{self.last['loss']:.3f}", tok_s=f"{self.last['tokens_per_s']:.0f}", refresh=False
            )

    def rewind(self, step: int) -> None:
        if not self.enabled:
            return
        for tracker in self.trackers:
            tracker.rewind(step)

    def close(self, *, failing: bool = False) -> None:
        """Flush and close every sink. ``failing``: the run is ending on an error already being
        reported (a full disk, say), so a sink that cannot flush is dropped quietly."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        for sink in [*self.trackers, self._events]:
            try:
                sink.close()
            except OSError:
                if not failing:
                    raise
