"""What happens around each training step, behind one interface (:class:`Hook`). Each component
owns its cadence, read from its own config keys: metrics records (:class:`Logging`,
``log.every``), the held-out loss (:class:`Evaluation`, ``eval.every``), checkpoints
(:class:`Checkpointing`, ``checkpoint.*``) and profiler traces (:class:`Profiling`,
``profile.steps``). The loop calls them in that order, then the hooks passed to
``train(cfg, hooks=[...])`` (tests inject faults this way; nothing test-only is built in a user's
run). The jitted step itself stays pure: a hook changes the host batch or the process, never the
compiled program."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from zaya_jax import checkpoint
from zaya_jax.config import Config
from zaya_jax.resilience import Watchdog
from zaya_jax.train.flops import flops_per_token
from zaya_jax.train.metrics import MetricsWriter, metric_record
from zaya_jax.train.programs import HeldOut
from zaya_jax.train.rundir import RunDir
from zaya_jax.train.throughput import Throughput

HostBatch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What a hook may use of the run, handed to :meth:`Hook.start` once the run is set up."""

    cfg: Config
    run: RunDir
    checkpoints: Checkpointing
    writer: MetricsWriter
    primary: bool  # process 0


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """A finished, accepted or skipped step as the hooks see it: the state and data position after
    it, what the step reported, and what earlier hooks measured (``eval_loss``)."""

    step: int
    state: Any  # TrainState; None when the next step was dispatched first (Hook.needs_state)
    data_state: dict[str, Any]
    metrics: dict[str, Any]  # the step's outputs (device arrays)
    plan: Any  # the StepPlan the batch was drawn for (schedule.py)
    counts: dict[str, int]  # skipped_steps, rollbacks so far
    last: bool  # the run's final step (saved by Checkpointing.end_run)
    time_save: bool = False  # a time-based save is due, as agreed by every process
    eval_loss: float | None = None  # the held-out loss measured after this step, if it was evaluated


class Hook:
    """A collaborator of the loop. Every method is optional (the defaults do nothing):
    ``start`` once the run is set up; ``before_step`` may replace the host batch; ``wants_save``
    proposes a save for this step (agreed across processes, with Checkpointing's clock);
    ``needs_state`` says that ``after_step`` reads ``end.state`` at this step; ``after_step`` may
    return a new :class:`StepEnd` for the hooks after it; ``end_run`` after the last step when the
    loop ends normally; ``close`` always, last.

    With ``train.dispatch_ahead`` (the default) the loop dispatches step t+1 before it reads step
    t's outcome, so ``before_step(t + 1)`` runs before ``after_step(t)``, and step t+1 consumes
    (donates) step t's state: ``end.state`` is None unless some hook's ``needs_state(t)`` was True,
    in which case step t is finished before step t+1 is dispatched."""

    def needs_state(self, step: int) -> bool:
        return False

    def start(self, run: RunContext) -> None:
        pass

    def before_step(self, step: int, batch: HostBatch) -> HostBatch:
        return batch

    def wants_save(self, step: int) -> bool:
        return False

    def after_step(self, end: StepEnd) -> StepEnd | None:
        return None

    def end_run(self, end: StepEnd) -> None:
        pass

    def close(self) -> None:
        pass


class Logging(Hook):
    """A metrics record every ``log.every`` steps and at every evaluated step; tokens/s and
    MFU over the steps since the previous record, evaluation time left out."""

    def __init__(self, cfg: Config, writer: MetricsWriter, meter: Throughput, also_at: Callable[[int], bool]):
        self.cfg, self.writer, self.meter, self.also_at = cfg, writer, meter, also_at
        self.last: dict[str, Any] = {}  # the latest record (the summary's final loss)

    def after_step(self, end: StepEnd) -> None:
        plan = end.plan
        self.meter.add(plan.tokens, plan.tokens * flops_per_token(self.cfg.model, plan.seq_len))
        if end.step % self.cfg.log.every == 0 or self.also_at(end.step):
            self.last = metric_record(
                end.step,
                end.metrics,  # the learning rates included: a record never waits for the state
                **self.meter.fields(),
                tokens_seen=end.data_state["tokens_seen"],
                **plan.fields(),
                **end.counts,
            )
            self.writer.write(self.last)
            self.meter.reset()


class Evaluation(Hook):
    """The held-out loss every ``eval.every`` steps and after the final step, written to
    ``metrics.jsonl`` as ``{"step", "eval_loss"}`` (plus the objective's other held-out metrics,
    ``eval_pair_accuracy`` ...) and passed on to the hooks after it."""

    def __init__(self, held_out: HeldOut, cfg: Config, writer: MetricsWriter, meter: Throughput):
        self.held_out, self.cfg, self.writer, self.meter = held_out, cfg, writer, meter
        self.last_loss: float | None = None

    def due(self, step: int) -> bool:
        return step % self.cfg.eval.every == 0 or step == self.cfg.train.steps

    def needs_state(self, step: int) -> bool:
        return self.due(step)

    def after_step(self, end: StepEnd) -> StepEnd | None:
        if not self.due(end.step):
            return None
        started = time.perf_counter()
        metrics = self.held_out(end.step, end.state)
        self.last_loss = metrics["loss"]
        self.meter.pause(time.perf_counter() - started)  # tokens/s counts training only
        self.writer.write({"step": end.step, **{f"eval_{name}": value for name, value in metrics.items()}})
        return dataclasses.replace(end, eval_loss=self.last_loss)


class Checkpointing(Hook):
    """Training checkpoints of one run: restore the latest readable one, save on the configured
    cadence (``checkpoint.every_steps`` / ``every_minutes``, every evaluated step with
    ``keep_best``) and after the last step, surface failed background saves."""

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
        self.clock: Callable[[], float] = time.monotonic  # of checkpoint.every_minutes
        self.last_save = self.clock()

    def restore(self, like: Any) -> tuple[tuple[Any, list[dict[str, Any]], int] | None, list[dict[str, Any]]]:
        """(latest readable (state, data states of every saving process, step) or None, ``checkpoint_unreadable`` event
        details of the ones moved to quarantine on the way)."""
        self.saver.finish()
        restored, unreadable = checkpoint.restore_training(
            self.run.checkpoints, like, verify_arrays=self.cfg.checkpoint.verify
        )
        self.saver.reload()  # quarantined step numbers are free again
        if restored is not None:
            self.saved_step = restored[2]
        return restored, unreadable

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

    def due(self, end: StepEnd) -> bool:
        ckpt = self.cfg.checkpoint
        return bool(
            (ckpt.every_steps and end.step % ckpt.every_steps == 0)
            or end.time_save
            or (ckpt.keep_best and end.eval_loss is not None)  # keep_best ranks evaluated steps
        )

    def save(self, end: StepEnd) -> None:
        self.watchdog.beat(end.step, "save")
        self.saver.save(end.step, self.cfg, end.state, end.data_state, end.eval_loss)
        self.saved_step, self.last_save = end.step, self.clock()

    def after_step(self, end: StepEnd) -> None:
        if not end.last and self.due(end):
            self.save(end)
        else:
            self.saver.check()  # a save that failed in the background stops the run here

    def end_run(self, end: StepEnd) -> None:
        """The final (or stop) step saved if it is not yet, and every save committed."""
        if end.step != self.saved_step:
            self.save(end)
        self.saver.finish()

    def close(self) -> None:
        self.saver.close()


class Profiling(Hook):
    """A ``jax.profiler`` trace of the steps ``profile.steps`` = [first, last] into
    ``<run>/profile/process_<i>/`` (open it with TensorBoard's profile plugin, or the
    ``*.trace.json.gz`` with Perfetto). A run resumed past ``first`` records nothing."""

    def __init__(self, cfg: Config, run: RunDir):
        self.window = cfg.profile.steps
        self.directory = run.path / "profile" / f"process_{jax.process_index()}"
        self.active = False

    def before_step(self, step: int, batch: HostBatch) -> HostBatch:
        if self.window and step == self.window[0]:
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        return batch

    def needs_state(self, step: int) -> bool:
        return bool(self.window) and step == self.window[1]

    def after_step(self, end: StepEnd) -> None:
        if self.active and end.step >= self.window[1]:
            jax.block_until_ready(end.state)  # the window's work inside the trace
            jax.profiler.stop_trace()
            self.active = False

    def close(self) -> None:
        if self.active:
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
