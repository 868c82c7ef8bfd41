"""Where metric records go besides the writer's bookkeeping: a tracker is anything with
``log(step, record)``, ``rewind(step)`` and ``close()`` (:class:`Tracker`): ``metrics.jsonl``
(always), TensorBoard, and the wandb/trackio dashboards (``log.trackers``)."""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from zaya_jax.config import Config, ConfigError, to_dict
from zaya_jax.files import filter_jsonl


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


def _summary_writer() -> type:
    """``tensorboardX.SummaryWriter``, imported without PyTorch. tensorboardX imports ``torch``
    whenever it is installed (only to accept its tensors, which a JAX run never logs): 3 s of every
    run's start-up where PyTorch sits beside JAX. While tensorboardX loads, ``torch`` is marked
    absent (unless already imported); the mark is removed right after, so ``import torch`` works
    as before."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardTracker:
    """TensorBoard scalars under the record's names (:func:`scalars`)."""

    def __init__(self, directory: Path, resume_step: int = 0):
        self.directory = directory
        self._open(resume_step)

    def _open(self, after_step: int) -> None:
        """Open the event files; points logged after ``after_step`` by an earlier attempt are
        purged (``purge_step``), so a resumed or rolled-back run shows each step once."""
        SummaryWriter = _summary_writer()
        # tensorboardX writes in a thread that dies on a failed write (a full disk) and leaves its
        # queue unread: with its default 10 places, the next add_scalar blocked the run for good.
        # A queue this deep never fills between two logs, and each log checks the thread first.
        self._tb = SummaryWriter(
            str(self.directory), purge_step=after_step + 1 if after_step else None, max_queue=100_000
        )

    def _check_writer(self) -> None:
        """Raise the storage error that stopped tensorboardX's writer thread, if it stopped."""
        worker = getattr(
            getattr(getattr(self._tb, "file_writer", None), "event_writer", None), "_worker", None
        )
        if worker is None or worker.is_alive():
            return
        full = os.statvfs(self.directory).f_bavail == 0
        raise OSError(
            errno.ENOSPC if full else errno.EIO,
            "No space left on device" if full else "TensorBoard's event writer stopped after a failed write",
            str(self.directory),
        )

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._check_writer()
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
                f"log.trackers includes {library!r} but it is not installed: pip install 'zaya-jax[{library}]' "
                f"or remove it from log.trackers"
            ) from None
        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        options: dict[str, Any] = {"project": cfg.log.project, "name": cfg.run.name, "config": to_dict(cfg)}
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
