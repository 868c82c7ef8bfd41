"""Training checkpoints of one run, as the loop calls them: restore the latest readable one, save
on the configured cadence (``checkpoint.every_steps`` / ``every_minutes``, every evaluated step
with ``keep_best``) and after the last step, surface failed background saves. The cadence is read
from ``checkpoint.*`` here, not in the loop (torchtitan's checkpointer decides when it saves).

An async save is committed at the first step boundary after its writes have finished on every
process (:meth:`Checkpointing.written`, agreed with the step's other proposals): the loop then waits
for the commit (and retention's deletions), which Orbax's background thread, starved by a busy
loop, would otherwise finish only when the loop next blocks, usually at the next save. The loop
never waits for unfinished writes there, and every process waits at the same step, so none waits
at Orbax's commit barrier for another's writes (:mod:`zaya_jax.checkpoint.training`).

A local tier (``checkpoint.local_dir``, ``local_every_steps``, ``local_keep``) is a second saver on
fast local storage, for one process: its steps are saved on their own cadence, committed as soon
as their writes are done, and a restore (or rollback) takes the freshest step of either tier whose
arrays verify (:func:`zaya_jax.checkpoint.restore_freshest`), so a restart after a fault loses only
the steps since the last local save, and a local tier lost with its node only those since the last
persistent one. Orbax's emergency checkpointing (0.12.8) is not used. Its ``CheckpointManager``
needs at least two data-parallel replicas along a replica axis of the mesh: with one it drops the
local directory and saves only the persistent checkpoint. Each slice holds a full copy of the state,
and a restore broadcasts one replica's copy to the rest. This stack's FSDP / expert layouts over
every device have no such axis. Its ``ReplicatorCheckpointManager`` saves each process's shards
locally, but assumes an outside replicator service copying them to persistent storage, and has no
persistent fallback for the model state. Several processes would each need their own tier: Orbax's
per-process saving (``MultiprocessingOptions(primary_host=None, active_processes={process})``, as
its ``p2p/local.py`` sets up), with the step every process holds and verifies agreed before a
restore. That is not built: a local tier with several processes is refused."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from zaya_jax import checkpoint
from zaya_jax.config import Config, ConfigError
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
        self.local = None
        if ckpt.local_dir:
            if jax.process_count() > 1:
                raise ConfigError(
                    "checkpoint.local_dir supports one process per run for now (each process would need "
                    "its own tier and a peer copy); drop checkpoint.local_dir or run one process"
                )
            self.local = checkpoint.TrainingSaver(
                local_checkpoints(ckpt.local_dir, run.path), async_save=ckpt.async_save,
                keep=ckpt.local_keep, keep_every=0, parameters=parameters,
            )  # fmt: skip
        self.restored_from = run.checkpoints  # the tier of the last restore (its ahead weights)
        self.saved_step = 0  # the last step saved (or restored: it is on disk already)
        self.clock: Callable[[], float] = time.monotonic  # of checkpoint.every_minutes
        self.last_save = self.clock()

    def restore(self, like: TrainState) -> tuple[Restored | None, list[dict[str, Any]]]:
        """(latest readable (state, data states of every saving process, step) or None,
        ``checkpoint_unreadable`` event details of the ones moved to quarantine on the way)."""
        self.saver.finish()
        options = {"verify_arrays": self.cfg.checkpoint.verify, "parameters": self.parameters}
        if self.local is None:  # one tier: no listing to compare
            restored, unreadable = checkpoint.restore_training(self.run.checkpoints, like, **options)
            source = None
        else:
            self.local.finish()
            tiers = [self.run.checkpoints, self.local.dir]
            restored, unreadable, source = checkpoint.restore_freshest(tiers, like, **options)
        self.restored_from = source or self.run.checkpoints
        for saver in (self.saver, self.local):
            if saver is not None:
                saver.reload()  # quarantined step numbers are free again
        if restored is not None:
            self.saved_step = restored[2]
        return restored, unreadable

    def restore_ahead(self, like: TrainState, count: int) -> list[dict[str, Any]] | None:
        """The ``count`` weights the producer saved beside its position (``ahead_weights``) in the
        checkpoint last restored, in ``like``'s layout; None when it holds none."""
        return checkpoint.restore_ahead(
            self.restored_from, self.saved_step, like, count,
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
        every, local = self.cfg.checkpoint.every_steps, self.cfg.checkpoint.local_every_steps
        return bool(every and step % every == 0) or bool(local and step % local == 0)

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
        return self._local_save(record)

    def _local_save(self, record: StepRecord) -> bool:
        """The local tier: commit a save whose writes are done, then save this step when due."""
        if self.local is None:
            return False
        if self.local.written():
            self.local.finish()
        every = self.cfg.checkpoint.local_every_steps
        if record.last or record.step % every:
            self.local.check()
            return False
        self.watchdog.beat(record.step, "save")
        self.local.save(record.step, self.cfg, record.state, record.data_state, None, record.ahead)
        return True

    def end_run(self, record: StepRecord) -> None:
        """The final (or stop) step saved if it is not yet, and every save committed."""
        if record.step != self.saved_step:
            self.save(record)
        self.saver.finish()
        if self.local is not None:
            self.local.finish()

    def close(self) -> None:
        try:
            self.saver.close()
        finally:
            if self.local is not None:
                self.local.close()


def local_checkpoints(local_dir: str, run_path: Path) -> Path:
    """The local tier of the run at ``run_path``: ``<local_dir>/<run name>-<hash of its path>/checkpoints``
    (two runs of one name in different places do not share it)."""
    where = Path(run_path).absolute()
    digest = hashlib.sha256(str(where).encode()).hexdigest()[:10]
    return Path(local_dir).expanduser() / f"{where.name}-{digest}" / "checkpoints"
