"""What observes each training step, behind one interface (:class:`Hook`), and the record every
observer receives (:class:`StepRecord`).

A hook declares what it needs when it is registered (:class:`Needs`: its cadence, the steps whose
state it reads, whether it proposes saves), so the loop asks no hook a question about the loop's
mechanics. Every hook of a step receives the same record, complete before the first is called:
the step's outputs, the data position, the held-out metrics when the step was evaluated, and
whether it was saved. No hook reads another's fields, and their order carries no meaning.

The built-in observers are :class:`Logging` (``log.every``: metrics records, the progress bar's
numbers) and :class:`Profiling` (``profile.steps``); the hooks passed to ``train(cfg,
hooks=[...])`` follow them (tests inject faults this way; nothing test-only is built in a user's
run). Evaluation and checkpoints are the loop's collaborators (:mod:`.evaluation`,
:mod:`.checkpointing`), called before the hooks. The jitted step itself stays pure: a hook changes
the host batch or the process, never the compiled program."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from zaya_jax.config import Config
from zaya_jax.train.checkpointing import Checkpointing
from zaya_jax.train.flops import flops_per_token
from zaya_jax.train.health import NodeHealth
from zaya_jax.train.metrics import MetricsWriter, eval_record, metric_record
from zaya_jax.train.record import StepRecord
from zaya_jax.train.rundir import RunDir
from zaya_jax.train.throughput import Throughput

HostBatch = dict[str, np.ndarray]


def _never(step: int) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a hook needs of the loop, declared once (``Hook.needs``):

    - ``every``: ``after_step`` is called at the steps divisible by it and at the run's last step;
    - ``state_at(step)``: ``after_step`` reads ``record.state`` at that step, so the loop finishes
      the step before it dispatches the next (with ``train.dispatch_ahead`` the state is otherwise
      consumed by the next step and ``record.state`` is None);
    - ``proposes_saves``: the loop asks ``wants_save(step)`` after every step; a save is taken
      when any process's hook proposes one (agreed by every process).
    """

    every: int = 1
    state_at: Callable[[int], bool] = _never
    proposes_saves: bool = False


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What a hook may use of the run, handed to :meth:`Hook.start` once the run is set up."""

    cfg: Config
    run: RunDir
    checkpoints: Checkpointing
    writer: MetricsWriter
    primary: bool  # process 0
    health: NodeHealth | None = None  # the node's probes (their monitor: what was found, when)


class Hook:
    """An observer of the loop. ``needs`` says what it needs (:class:`Needs`); every method is
    optional (the defaults do nothing): ``start`` once the run is set up; ``before_step`` may
    replace the host batch; ``wants_save`` proposes a save for this step (asked only with
    ``needs.proposes_saves``); ``after_step`` on its cadence; ``end_run`` after the last step when
    the loop ends normally; ``close`` always, last.

    With ``train.dispatch_ahead`` (the default) the loop dispatches step t+1 before it reads step
    t's outcome, so ``before_step(t + 1)`` runs before ``after_step(t)``."""

    needs = Needs()

    def start(self, run: RunContext) -> None:
        pass

    def before_step(self, step: int, batch: HostBatch) -> HostBatch:
        return batch

    def wants_save(self, step: int) -> bool:
        return False

    def after_step(self, record: StepRecord) -> None:
        pass

    def end_run(self, record: StepRecord) -> None:
        pass

    def close(self) -> None:
        pass


def notify(hooks: list[Hook], record: StepRecord) -> None:
    """``after_step(record)`` of every hook whose cadence includes the step."""
    for hook in hooks:
        if record.step % hook.needs.every == 0 or record.last:
            hook.after_step(record)


class Logging(Hook):
    """A metrics record every ``log.every`` steps and at every evaluated step, then the held-out
    metrics (``{"step", "eval_loss", ...}``) when it was evaluated; tokens/s and MFU over the
    steps since the previous record (evaluation time left out by the loop's meter)."""

    def __init__(self, cfg: Config, writer: MetricsWriter, meter: Throughput):
        self.cfg, self.writer, self.meter = cfg, writer, meter

    def after_step(self, record: StepRecord) -> None:
        plan = record.plan
        self.meter.add(plan.tokens, plan.tokens * flops_per_token(self.cfg.model, plan.seq_len))
        if record.step % self.cfg.log.every == 0 or record.eval is not None:
            self.writer.write(
                metric_record(
                    record.step,
                    record.metrics,  # the learning rates included: a record never waits for the state
                    **self.meter.fields(),
                    tokens_seen=record.data_state["tokens_seen"],
                    **plan.fields(),
                    **record.counts,
                )
            )
            self.meter.reset()
        if record.eval is not None:
            self.writer.write(eval_record(record.step, record.eval))


class Profiling(Hook):
    """A ``jax.profiler`` trace of the steps ``profile.steps`` = [first, last] into
    ``<run>/profile/process_<i>/`` (open it with TensorBoard's profile plugin, or the
    ``*.trace.json.gz`` with Perfetto). A run resumed past ``first`` records nothing."""

    def __init__(self, cfg: Config, run: RunDir):
        self.window = cfg.profile.steps
        self.directory = run.path / "profile" / f"process_{jax.process_index()}"
        self.active = False
        self.needs = Needs(state_at=lambda step: bool(self.window) and step == self.window[1])

    def before_step(self, step: int, batch: HostBatch) -> HostBatch:
        if self.window and step == self.window[0]:
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        return batch

    def after_step(self, record: StepRecord) -> None:
        if self.active and record.step >= self.window[1]:
            jax.block_until_ready(record.state)  # the window's work inside the trace
            jax.profiler.stop_trace()
            self.active = False

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
