"""Where training metrics go: trackers (``metrics.jsonl``, TensorBoard), ``events.jsonl`` for run
events, and a progress bar; and how a step's outputs become one metrics record.

A tracker is anything with ``log(step, record)``, ``rewind(step)`` and ``close()``
(:class:`Tracker`); :class:`MetricsWriter` sends every record to each of them: ``metrics.jsonl``
always, and those of ``run.trackers`` (TensorBoard, wandb, trackio).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from tqdm import tqdm

from zaya_jax.config import Config, ConfigError, to_dict
from zaya_jax.files import EVENTS, event_line, filter_jsonl

# Step outputs that steer the loop (the loss guard), not metrics of the run.
CONTROL_KEYS = ("skipped", "nonfinite")


def metric_record(step: int, metrics: dict[str, Any], **host: Any) -> dict[str, Any]:
    """One ``metrics.jsonl`` record: every output of the jitted step under its own name, then the
    host-side fields ``host``; arrays become floats (scalars) or lists rounded to 4 decimals."""
    fields = {k: v for k, v in jax.device_get({**metrics, **host}).items() if k not in CONTROL_KEYS}
    return {"step": step, **{name: _python(value) for name, value in fields.items()}}


def _python(value: Any) -> Any:
    if not isinstance(value, np.ndarray | np.generic):
        return value
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else [round(float(x), 4) for x in value.reshape(-1)]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Tracker(Protocol):
    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def rewind(self, step: int) -> None: ...

    def close(self) -> None: ...


class JsonlTracker:
    """``metrics.jsonl``: flushed line by line, so a crash loses nothing already logged."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a")

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def rewind(self, step: int) -> None:
        """Drop the lines after ``step`` (a rollback re-runs those step numbers), atomically."""
        self._file.close()
        filter_jsonl(self.path, lambda record: record["step"] <= step)
        self._file = self.path.open("a")

    def close(self) -> None:
        self._file.close()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers as flat scalars for dashboards: a vector ``v`` as ``v/0``, ``v/1``, ...;
    ``step`` and nulls left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or value is None or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out[key] = value
        elif isinstance(value, list) and all(isinstance(v, int | float) for v in value):
            out.update({f"{key}/{i}": v for i, v in enumerate(value)})
    return out


class TensorBoardTracker:
    """TensorBoard scalars under the record's names (:func:`scalars`)."""

    def __init__(self, directory: Path, resume_step: int = 0):
        self.directory = directory
        self._open(resume_step)

    def _open(self, after_step: int) -> None:
        """Open the event files; points logged after ``after_step`` by an earlier attempt are
        purged (``purge_step``), so a resumed or rolled-back run shows each step once."""
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(self.directory), purge_step=after_step + 1 if after_step else None)

    def log(self, step: int, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self._tb.add_scalar(key, value, step)

    def rewind(self, step: int) -> None:
        self._tb.close()
        self._open(step)

    def close(self) -> None:
        self._tb.close()


class DashboardTracker:
    """``wandb`` or ``trackio`` (the same ``init`` / ``log`` / ``finish`` API), behind their extras.
    The run id is derived from the run directory, so a resumed run continues the same dashboard
    run. Neither can take steps back: after a rollback, the repeated steps keep their first values
    there (``metrics.jsonl`` and TensorBoard are rewound)."""

    def __init__(self, library: str, cfg: Config, run_dir: Path):
        try:
            self._lib = importlib.import_module(library)
        except ImportError:
            raise ConfigError(
                f"run.trackers includes {library!r} but it is not installed: pip install 'zaya-jax[{library}]' "
                f"or remove it from run.trackers"
            ) from None
        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        options: dict[str, Any] = {"project": cfg.run.project, "name": cfg.run.name, "config": to_dict(cfg)}
        if library == "wandb":
            options.update(dir=str(run_dir), id=run_id, resume="allow")
        else:
            options.update(resume="allow")
        self._run = self._lib.init(**options)

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._lib.log(scalars(record), step=step)

    def rewind(self, step: int) -> None:
        pass  # see the class docstring

    def close(self) -> None:
        self._lib.finish()


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
        TensorBoard drops points logged after it). ``cfg.run.trackers`` choose the trackers beside
        ``metrics.jsonl`` (default: TensorBoard)."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._step = resume_step
        if not enabled:
            return
        self.trackers: list[Tracker] = [JsonlTracker(self.run_dir / "metrics.jsonl")]
        for name in cfg.run.trackers if cfg is not None else ("tensorboard",):
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

    def advance(self, last: dict[str, Any]) -> None:
        if not self.enabled or self._bar is None:
            return
        self._bar.update(1)
        if last:
            self._bar.set_postfix(
                loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}", refresh=False
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


def start_event(
    writer: MetricsWriter,
    cfg: Config,
    layout: Any,
    peak: float,
    peak_source: str,
    resumed_after: int,
    initialized: dict[str, Any] | None,
) -> None:
    """The run's ``start`` event (peak FLOPs and their source, devices, mesh, XLA flags, runtime),
    and a few lines on stderr saying what is starting: a new run, a resumed one (``resumed_after``
    > 0) or one from existing weights (``initialized``)."""
    origin = f"resuming after step {resumed_after}" if resumed_after else "new run"
    origin = f"new run from the weights of {initialized['source']}" if initialized else origin
    from zaya_jax.model import param_counts

    writer.event(
        "start",
        peak_flops=peak,
        peak_source=peak_source,
        devices=jax.device_count(),
        mesh=layout.describe(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        runtime=to_dict(cfg.runtime),
    )
    if writer.enabled:
        counts = param_counts(cfg.model)
        mesh = (
            " x ".join(f"{name} {size}" for name, size in layout.describe().items() if size > 1)
            or "one device"
        )
        print(
            f"zaya train: {writer.run_dir} ({origin})\n"
            f"zaya train: {_count(counts['total_params'])} parameters ({_count(counts['active_params'])} active), "
            f"{jax.device_count()} {jax.devices()[0].platform} device(s), mesh {mesh}",
            file=sys.stderr,
            flush=True,
        )


def _count(n: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


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
