"""What happens around each training step, behind one small interface (:class:`StepHook`):
checkpoint cadence (:class:`Checkpointing`), test-only fault injection (:class:`FaultHook`) and
profiler traces (:class:`ProfileHook`), plus the SIGTERM/SIGINT stop request. The jitted step itself stays pure: a fault is injected into the
host batch or the process, never into the compiled program."""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time
from typing import Any, Protocol

import jax
import numpy as np

from zaya_jax import checkpoint
from zaya_jax.config import Config
from zaya_jax.resilience import Faults, Watchdog, corrupt_checkpoint
from zaya_jax.train.rundir import RunDir

HostBatch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """A finished step as the hooks see it: the state after it and the data position after it."""

    step: int
    state: Any  # TrainState
    data_state: dict[str, Any]
    last: bool  # the run's final step (saved by the driver after the loop)
    time_save: bool = False  # a time-based save is due, as agreed by every process
    eval_loss: float | None = None  # the held-out loss measured after this step, if it was evaluated


class StepHook(Protocol):
    def before_step(self, step: int, batch: HostBatch) -> HostBatch: ...

    def after_step(self, end: StepEnd) -> None: ...


class Checkpointing:
    """Training checkpoints of one run: restore the latest readable one, save on the configured
    cadence (``checkpoint.every_steps`` / ``every_minutes``), surface failed background saves."""

    def __init__(self, cfg: Config, run: RunDir, watchdog: Watchdog):
        self.cfg, self.run, self.watchdog = cfg, run, watchdog
        ckpt = cfg.checkpoint
        self.saver = checkpoint.TrainingSaver(
            run.checkpoints,
            async_save=ckpt.async_save,
            keep=ckpt.keep,
            keep_every=ckpt.keep_every,
            keep_best=ckpt.keep_best,
        )
        self.saved_step = 0  # the last step saved (or restored: it is on disk already)
        self.skew = cfg.debug.clock_skew_s if jax.process_index() > 0 else 0.0
        self.last_save = time.monotonic()

    def restore(self, like: Any) -> tuple[tuple[Any, dict[str, Any], int] | None, list[dict[str, Any]]]:
        """(latest readable (state, data_state, step) or None, ``checkpoint_unreadable`` event
        details of the ones moved to quarantine on the way)."""
        self.saver.finish()
        restored, unreadable = checkpoint.restore_training(
            self.run.checkpoints, like, verify_arrays=self.cfg.checkpoint.verify
        )
        self.saver.reload()  # quarantined step numbers are free again
        if restored is not None:
            self.saved_step = restored[2]
        return restored, unreadable

    def time_due(self) -> bool:
        """Whether this process's clock says a ``checkpoint.every_minutes`` save is due (a proposal:
        the loop acts on the value agreed by every process)."""
        minutes = self.cfg.checkpoint.every_minutes
        return bool(minutes and time.monotonic() + self.skew - self.last_save >= 60 * minutes)

    def due(self, end: StepEnd) -> bool:
        ckpt = self.cfg.checkpoint
        return bool(
            (ckpt.every_steps and end.step % ckpt.every_steps == 0)
            or end.time_save
            or (ckpt.keep_best and end.eval_loss is not None)  # keep_best ranks evaluated steps
        )

    def save(self, step: int, state: Any, data_state: dict[str, Any], eval_loss: float | None = None) -> None:
        self.watchdog.beat(step, "save")
        self.saver.save(step, self.cfg, state, data_state, eval_loss)
        self.saved_step, self.last_save = step, time.monotonic()

    def before_step(self, step: int, batch: HostBatch) -> HostBatch:
        return batch

    def after_step(self, end: StepEnd) -> None:
        if not end.last and self.due(end):
            self.save(end.step, end.state, end.data_state, end.eval_loss)
        else:
            self.saver.check()  # a save that failed in the background stops the run here

    def finish(self) -> None:
        self.saver.finish()

    def close(self) -> None:
        self.saver.close()


class FaultHook:
    """The ``debug.*`` faults (tests only), each fired once per run directory: a NaN loss (the
    step's loss mask poisoned on the host), a crash during a save, a corrupted checkpoint, a crash
    and a hang after a step."""

    def __init__(self, cfg: Config, run: RunDir, checkpoints: Checkpointing, *, primary: bool):
        self.faults = Faults(cfg.debug, run.path, primary=primary)
        self.checkpoints = checkpoints

    def before_step(self, step: int, batch: HostBatch) -> HostBatch:
        if self.faults.due("nan_at_step", step):
            return {**batch, "loss_mask": batch["loss_mask"] * np.float32(math.nan)}
        return batch

    def after_step(self, end: StepEnd) -> None:
        step, saved = end.step, self.checkpoints.saved_step == end.step
        if saved and self.faults.due("crash_during_save_at_step", step):
            self.faults.crash()  # the save is still being written in the background
        if saved and self.faults.due("corrupt_checkpoint_at_step", step):
            self.checkpoints.finish()
            corrupt_checkpoint(self.checkpoints.run.checkpoints / str(step))
        if self.faults.due("crash_at_step", step):
            self.faults.crash()
        if self.faults.due("hang_at_step", step):
            self.faults.hang()


class ProfileHook:
    """A ``jax.profiler`` trace of the steps ``run.profile_steps`` = [first, last] into
    ``<run>/profile/process_<i>/`` (open it with TensorBoard's profile plugin, or the
    ``*.trace.json.gz`` with Perfetto). A run resumed past ``first`` records nothing."""

    def __init__(self, cfg: Config, run: RunDir):
        self.window = cfg.run.profile_steps
        self.directory = run.path / "profile" / f"process_{jax.process_index()}"
        self.active = False

    def before_step(self, step: int, batch: HostBatch) -> HostBatch:
        if self.window and step == self.window[0]:
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        return batch

    def after_step(self, end: StepEnd) -> None:
        if self.active and end.step >= self.window[1]:
            jax.block_until_ready(end.state)  # the window's work inside the trace
            jax.profiler.stop_trace()
            self.active = False


class StopRequest:
    """SIGTERM/SIGINT handling: a signal asks the loop to save a checkpoint and exit. ``requested``
    is this process's own request; the loop stops on the one agreed by all processes."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
