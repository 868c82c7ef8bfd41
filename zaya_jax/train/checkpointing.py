"""Training checkpoints of one run, as the loop calls them: restore the latest readable one, save
on the configured cadence (``checkpoint.every_steps`` / ``every_minutes``, every evaluated step
with ``keep_best``) and after the last step, surface failed background saves. The cadence is read
from ``checkpoint.*`` here, not in the loop (torchtitan's checkpointer decides when it saves).

An async save is committed at the first step boundary after its writes have finished on every
process (:meth:`Checkpointing.written`, agreed with the step's other proposals): the loop then waits
for the commit (and retention's deletions), which Orbax's background thread, starved by a busy
loop, would otherwise finish only when the loop next blocks, usually at the next save. The loop
never waits for unfinished writes there, and every process waits at the same step, so none waits
at Orbax's commit barrier for another's writes (:mod:`zaya_jax.checkpoint.training`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from zaya_jax import checkpoint
from zaya_jax.config import Config
from zaya_jax.lora.plan import ParameterPlan
from zaya_jax.programs import TrainState
from zaya_jax.resilience import Watchdog
from zaya_jax.train.record import StepRecord
from zaya_jax.train.rundir import RunDir

Restored = tuple[TrainState, list[dict[str, Any]], int]  # state, data states of every saving process, step


class Checkpointing:
    """One run's checkpoints (``<run>/checkpoints/<step>/``, :class:`zaya_jax.checkpoint.TrainingSaver`)."""

    def __init__(self, cfg: Config, run: RunDir, watchdog: Watchdog, parameters: ParameterPlan):
        self.cfg, self.run, self.watchdog, self.parameters = cfg, run, watchdog, parameters
        ckpt = cfg.checkpoint
        self.saver = checkpoint.TrainingSaver(
            run.checkpoints,
            async_save=ckpt.async_save,
            keep=ckpt.keep,
            keep_every=ckpt.keep_every,
            keep_best=ckpt.keep_best,
            parameters=parameters,
        )
        self.saved_step = 0  # the last step saved (or restored: it is on disk already)
        self.clock: Callable[[], float] = time.monotonic  # of checkpoint.every_minutes
        self.last_save = self.clock()

    def restore(self, like: TrainState) -> tuple[Restored | None, list[dict[str, Any]]]:
        """(latest readable (state, data states of every saving process, step) or None,
        ``checkpoint_unreadable`` event details of the ones moved to quarantine on the way)."""
        self.saver.finish()
        restored, unreadable = checkpoint.restore_training(
            self.run.checkpoints, like, verify_arrays=self.cfg.checkpoint.verify, parameters=self.parameters
        )
        self.saver.reload()  # quarantined step numbers are free again
        if restored is not None:
            self.saved_step = restored[2]
        return restored, unreadable

    def restore_ahead(self, like: TrainState, count: int) -> list[dict[str, Any]] | None:
        """The ``count`` weights the producer saved beside its position (``ahead_weights``) in the
        checkpoint last restored, in ``like``'s layout; None when it holds none."""
        return checkpoint.restore_ahead(
            self.run.checkpoints, self.saved_step, like, count,
            verify_arrays=self.cfg.checkpoint.verify, parameters=self.parameters,
        )  # fmt: skip

    def wants_save(self, step: int) -> bool:
        """Whether this process's clock says a ``checkpoint.every_minutes`` save is due (a proposal:
        the loop acts on the value agreed by every process)."""
        minutes = self.cfg.checkpoint.every_minutes
        return bool(minutes and self.clock() - self.last_save >= 60 * minutes)

    def needs_state(self, step: int) -> bool:
        """A step-count save (a time-based one is agreed after the step: taken at the next step the
        loop finishes before dispatching on; ``keep_best`` saves evaluated steps, finished anyway)."""
        every = self.cfg.checkpoint.every_steps
        return bool(every and step % every == 0)

    def _due(self, record: StepRecord) -> bool:
        ckpt = self.cfg.checkpoint
        return bool(
            (ckpt.every_steps and record.step % ckpt.every_steps == 0)
            or record.time_save
            or (ckpt.keep_best and record.eval is not None)  # keep_best ranks evaluated steps
        )

    def save(self, record: StepRecord) -> None:
        self.watchdog.beat(record.step, "save")
        self.saver.save(
            record.step, self.cfg, record.state, record.data_state, record.eval_loss, record.ahead
        )
        self.saved_step, self.last_save = record.step, self.clock()

    def written(self) -> bool:
        """Whether the save in flight has finished its writes on this process (a proposal: the
        loop commits it at the step every process agrees on)."""
        return self.saver.written()

    def after_step(self, record: StepRecord) -> bool:
        """Saves ``record``'s step when it is due (not the last: :meth:`end_run` saves it); returns
        whether it did. Else commits the save in flight once every process has written it. A save
        that failed in the background stops the run here."""
        if not record.last and self._due(record):
            self.save(record)
            return True
        if record.save_written:
            self.saver.finish()  # its writes are done everywhere: the commit is what is left
        else:
            self.saver.check()
        return False

    def end_run(self, record: StepRecord) -> None:
        """The final (or stop) step saved if it is not yet, and every save committed."""
        if record.step != self.saved_step:
            self.save(record)
        self.saver.finish()

    def close(self) -> None:
        self.saver.close()
