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
fast local storage, each process saving its own shards to its own node
(:mod:`zaya_jax.checkpoint.local`): its steps are saved on their own cadence, and a restore (or
rollback) takes the newest local step every process holds and verifies, else the persistent tier's
latest, so a restart after a fault loses only the steps since the last local save, and a local tier
lost with its node only those since the last persistent one. With one process a local save is
asynchronous and committed at the first step boundary after its writes; with several it is
synchronous, every process committing its part before the next step. Orbax 0.12.8 announces that
an asynchronous save's directories exist under keys of the coordination service that every
process's own save of the same operation shares: two processes saving their own directories at
once failed (a directory removed under another's writes) or waited 5 minutes for a key. Why not
Orbax's emergency checkpointing: :mod:`zaya_jax.checkpoint.local`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from zaya_jax import checkpoint
from zaya_jax.checkpoint.local import clear_after, local_tier, restore_local
from zaya_jax.config import Config, ConfigError, to_dict
from zaya_jax.lora.plan import ParameterPlan
from zaya_jax.parallel.distributed import gather_strings
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
            if jax.process_count() > 1 and ckpt.local_keep < 2:
                raise ConfigError(
                    f"checkpoint.local_keep={ckpt.local_keep} with {jax.process_count()} processes: a process "
                    "killed between the others' commit of a local step and its own would leave no step every "
                    "process holds; set checkpoint.local_keep >= 2"
                )
            self.local = checkpoint.TrainingSaver(
                local_tier(ckpt.local_dir, run.path), async_save=ckpt.async_save and jax.process_count() == 1,
                keep=ckpt.local_keep, keep_every=0, parameters=parameters, per_process=True,
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
        restored, unreadable, source = None, [], self.run.checkpoints
        if self.local is not None:
            self.local.finish()
            restored, unreadable = restore_local(
                self.local.dir, like, not_before=checkpoint.latest_step(self.run.checkpoints),
                mesh=to_dict(self.cfg)["mesh"], gather=self._gather, **options,
            )  # fmt: skip
            source = self.local.dir if restored is not None else source
        if restored is None:
            restored, persistent = checkpoint.restore_training(self.run.checkpoints, like, **options)
            unreadable += persistent
        if self.local is not None:  # local steps not every process holds: saved again from here
            clear_after(self.local.dir, 0 if restored is None else restored[2])
        self.restored_from = source
        for saver in (self.saver, self.local):
            if saver is not None:
                saver.reload()  # quarantined step numbers are free again
        if restored is not None:
            self.saved_step = restored[2]
        return restored, unreadable

    def _gather(self, name: str, value: str) -> list[str] | None:
        return gather_strings(name, value, self.cfg.runtime.barrier_timeout_s)

    @property
    def restored_tier(self) -> str:
        """The tier of the last restore: "local" or "persistent"."""
        return "persistent" if self.restored_from == self.run.checkpoints else "local"

    def restore_ahead(self, like: TrainState, count: int) -> list[dict[str, Any]] | None:
        """The ``count`` weights the producer saved beside its position (``ahead_weights``) in the
        checkpoint last restored, in ``like``'s layout; None when it holds none."""
        return checkpoint.restore_ahead(
            self.restored_from, self.saved_step, like, count, verify_arrays=self.cfg.checkpoint.verify,
            parameters=self.parameters, per_process=self.restored_tier == "local",
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
        cfg = self.cfg.at_stage(record.plan.stage)  # the model in force: its stage's RoPE
        self.saver.save(record.step, cfg, record.state, record.data_state, record.eval_loss, record.ahead)
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
        if self.local.written():  # one process: its save in flight is committed here
            self.local.finish()
        every = self.cfg.checkpoint.local_every_steps
        if record.last or record.step % every:
            self.local.check()
            return False
        self.watchdog.beat(record.step, "save")
        cfg = self.cfg.at_stage(record.plan.stage)
        self.local.save(record.step, cfg, record.state, record.data_state, None, record.ahead)
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
