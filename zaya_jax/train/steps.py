"""One training step's work as the step pipeline (:mod:`.pipeline`) schedules it: draw a batch,
dispatch the step, and finish it in four small parts: judge (the outcome and what it calls for),
agree (with every other process), apply (skip, roll back, stop or accept) and notify (evaluation,
checkpoints, then every hook, with one record)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from zaya_jax.config import Config
from zaya_jax.data import Prefetcher
from zaya_jax.lora.plan import B_GRAD_NORMS
from zaya_jax.objectives import HostBatch, Producer, StepPlan
from zaya_jax.optim import batch_lr_scale
from zaya_jax.parallel import put_batch
from zaya_jax.programs import Programs, TrainState
from zaya_jax.resilience import (
    LossGuard,
    MetricBoundError,
    NonFiniteLossError,
    RoutingAlarmError,
    RoutingMonitor,
    Watchdog,
)
from zaya_jax.resilience.goodput import Goodput
from zaya_jax.resilience.routing import RoutingAlarm
from zaya_jax.train.checkpointing import Checkpointing
from zaya_jax.train.compiled import TrainStep
from zaya_jax.train.consensus import Agreed, StopRequest, agree
from zaya_jax.train.decisions import Action, Decision, Outcome, decide, decide_routing
from zaya_jax.train.evaluation import Evaluation
from zaya_jax.train.health import NodeHealth
from zaya_jax.train.hooks import Hook, notify
from zaya_jax.train.metrics import MetricsWriter
from zaya_jax.train.pipeline import Finished
from zaya_jax.train.record import StepRecord
from zaya_jax.train.schedule import final_batch_size
from zaya_jax.train.throughput import Throughput


@dataclasses.dataclass(frozen=True)
class Drawn:
    """A batch as the producer gave it (before the hooks): a step dispatched ahead and then
    discarded by a rollback decided on its predecessor trains the same batch again."""

    plan: StepPlan
    host_batch: HostBatch
    data_state: dict[str, Any]
    ahead: list[dict[str, Any]] | None = None  # the producer's ahead_weights() with data_state


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """A step whose program is running (or done) and whose outcome has not been read yet."""

    step: int
    drawn: Drawn
    metrics: dict[str, Any]
    limit: float


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a step's outcome calls for (judged by this process alone)."""

    outcome: Outcome
    decision: Decision
    alarm: RoutingAlarm | None


@dataclasses.dataclass
class Collaborators:
    """What the steps are done with: the run's config, programs and sinks, its producer and the
    loop's collaborators (evaluation, checkpoints, hooks)."""

    cfg: Config
    programs: Programs
    train_step: TrainStep
    producer: Producer
    batches: Prefetcher
    watchdog: Watchdog
    writer: MetricsWriter
    meter: Throughput
    evaluation: Evaluation
    checkpoints: Checkpointing
    hooks: list[Hook]
    health: NodeHealth
    goodput: Goodput


class TrainingSteps:
    """The loop's :class:`~zaya_jax.train.pipeline.Steps`: ``(state, drawn, dispatched, record)``
    are (:class:`TrainState`, :class:`Drawn`, :class:`Dispatched`, :class:`StepRecord`)."""

    def __init__(self, run: Collaborators, stop: StopRequest):
        self.run, self.stop = run, stop
        cfg = run.cfg
        self.guard = LossGuard(cfg.resilience, lag=int(cfg.train.dispatch_ahead))
        self.routing = RoutingMonitor(cfg)
        self.counts = {"skipped_steps": 0, "rollbacks": 0}
        self.parameters = run.programs.layout.parameters
        self.adapters_checked = not self.parameters.guards_inert_adapters  # once per process

    def must_finish(self, step: int) -> bool:
        """The last step, every step of an on-policy producer, a step whose state is read."""
        r = self.run
        return (
            step == r.cfg.train.steps
            or r.producer.on_policy
            or r.evaluation.due(step)
            or r.checkpoints.needs_state(step)
            or any(hook.needs.state_at(step) for hook in r.hooks)
        )

    def draw(self, state: TrainState) -> Drawn:
        r, wait_start = self.run, time.perf_counter()
        if r.producer.on_policy:
            r.producer.observe(state)  # the batch is sampled from these weights
        plan, host_batch, data_state = next(r.batches)
        waited = time.perf_counter() - wait_start
        r.meter.data_wait += waited
        r.goodput.add("data_wait", waited)
        ahead = getattr(r.producer, "ahead_weights", None)  # optional (see Producer)
        return Drawn(plan, host_batch, data_state, ahead() if ahead is not None else None)

    def dispatch(self, step: int, state: TrainState, drawn: Drawn) -> tuple[TrainState, Dispatched]:
        """Run the hooks' ``before_step`` and start step ``step``; returns its (future) state."""
        r, host_batch = self.run, drawn.host_batch
        for hook in r.hooks:
            host_batch = hook.before_step(step, host_batch)
        plan = drawn.plan
        lr_scale = plan.lr_scale * batch_lr_scale(
            plan.batch_size, final_batch_size(r.cfg), r.cfg.optim.lr_batch_scaling
        )
        limit = self.guard.limit(step)
        batch = put_batch(host_batch, r.programs.layout.batch)
        state, metrics = r.train_step(step, state, batch, lr_scale, limit, plan.stage)
        Outcome.prefetch(metrics)
        r.watchdog.beat(step)
        return state, Dispatched(step, drawn, metrics, limit)

    def finish(
        self, done: Dispatched, state: TrainState | None, latest: TrainState, time_save: bool
    ) -> Finished[TrainState, StepRecord]:
        """Judge step ``done``, agree with every process, apply the decision, notify the hooks."""
        verdict = self.judge(done)
        agreed = self.agree(done.step, verdict)
        unhealthy = self.run.health.act(agreed.health, done.step)  # "drain", or it raised (stop)
        restored = self.apply(done, verdict, latest)
        r = self.run
        if restored is not None:
            r.goodput.step(done.step, "rollback")  # the bad step, the restore; the undone steps moved
            return Finished(restored=restored)
        record = StepRecord(
            done.step, state, done.drawn.data_state, done.metrics, done.drawn.plan, dict(self.counts),
            done.step == r.cfg.train.steps,
            time_save or (agreed.time_save and state is not None),  # else taken at the next step
            save_written=agreed.save_written, ahead=done.drawn.ahead,
        )  # fmt: skip
        record = self.notify(record)
        r.goodput.step(done.step, "skipped" if verdict.outcome.skipped else "productive")
        if record.saved:
            r.goodput.saved(done.step)
        return Finished(
            record,
            stop=agreed.stop or unhealthy,
            stopped_by=agreed.stopped_by,
            time_save=agreed.time_save and state is None,
        )

    def judge(self, done: Dispatched) -> Verdict:
        """The step's outcome and decision; an accepted step's routing goes to the monitor, whose
        alarm (told to the user through the writer) may change the decision."""
        cfg, rollbacks = self.run.cfg, self.counts["rollbacks"]
        if not self.adapters_checked:
            self.adapters_checked = self.parameters.refuse_inert(done.metrics[B_GRAD_NORMS], done.step)
        outcome = Outcome.of(done.step, done.metrics, done.limit, self.run.programs.bound.bounds)
        decision = decide(outcome, cfg.resilience, rollbacks)
        alarm = (
            self.routing.add(done.step, done.metrics["routing"]) if decision.action is Action.ACCEPT else None
        )
        if alarm is not None:
            decision = decide_routing(alarm, cfg.resilience, rollbacks)
            action = cfg.resilience.on_routing_alarm
            self.run.writer.notice(
                "routing_alarm", f"{alarm.message} (on_routing_alarm={action})",
                at_step=done.step, **alarm.detail(), action=action,
            )  # fmt: skip
        return Verdict(outcome, decision, alarm)

    def agree(self, step: int, verdict: Verdict) -> Agreed:
        """Save proposals, stop signals, the decision and whether the save in flight is written,
        agreed by every process."""
        r = self.run
        time_due = r.checkpoints.wants_save(step) or any(
            hook.wants_save(step) for hook in r.hooks if hook.needs.proposes_saves
        )
        save_due = (
            time_due or self.stop.requested or step == r.cfg.train.steps or r.checkpoints.needs_state(step)
        )
        return agree(
            step, time_due=time_due, stop=self.stop.requested, action=verdict.decision.action,
            written=r.checkpoints.written(), health=r.health.pending(save_due),
            timeout_s=r.cfg.runtime.barrier_timeout_s,
        )  # fmt: skip

    def apply(self, done: Dispatched, verdict: Verdict, latest: TrainState) -> tuple[TrainState, int] | None:
        """Count a skip, raise for a stop, roll back (returns the restored state and step) or
        accept the step's loss into the guard."""
        r, outcome, decision = self.run, verdict.outcome, verdict.decision
        if outcome.skipped:
            self.counts["skipped_steps"] += 1
            detail = {
                "reason": outcome.reason,
                "at_step": done.step,
                "loss": outcome.loss,
                "limit": done.limit,
            }
            if outcome.exceeded is not None:  # a metric past its objective's bound: the user is told
                bound, value = outcome.exceeded
                detail.update(metric=bound.metric, value=value, bound=bound.limit, setting=bound.setting)
            if decision.action is Action.SKIP and decision.message:
                r.writer.notice("skip", decision.message, **detail)
            else:
                r.writer.event("skip", **detail)
        if decision.action is Action.STOP:
            bounded = outcome.exceeded is not None and not outcome.nonfinite
            error = (
                RoutingAlarmError if verdict.alarm else MetricBoundError if bounded else NonFiniteLossError
            )
            raise error(decision.message)
        if decision.action is Action.ROLLBACK:
            restored = rollback(r.checkpoints, r.writer, latest, decision.reason or outcome.reason, done.step)
            self.routing.reset()
            if restored is not None:
                self.counts["rollbacks"] += 1
                r.goodput.rolled_back(restored[1])
            return restored
        if decision.action is Action.ACCEPT:
            self.guard.accept(outcome.loss, done.step)
        return None

    def notify(self, record: StepRecord) -> StepRecord:
        """Evaluate (when due), save (when due), then every hook with the one complete record."""
        r = self.run
        record = dataclasses.replace(record, eval=r.evaluation(record.step, record.state, record.plan.stage))
        started = time.perf_counter()
        record = dataclasses.replace(record, saved=r.checkpoints.after_step(record))
        r.goodput.add("checkpoint", time.perf_counter() - started)
        notify(r.hooks, record)
        r.writer.advance()
        return record


def rollback(
    checkpoints: Checkpointing, writer: MetricsWriter, state: TrainState, reason: str, at_step: int
) -> tuple[TrainState, int] | None:
    """Back to the last readable checkpoint: (its state, its step), or None when there is none
    (the bad update was only skipped). The data stream goes on: the window since is skipped."""
    restored, unreadable = checkpoints.restore(state)
    for detail in unreadable:
        writer.event("checkpoint_unreadable", **detail)
    if restored is None:
        writer.event("rollback_unavailable", reason=reason, at_step=at_step)
        return None
    state, _, to_step = restored
    writer.rewind(to_step)
    writer.event("rollback", reason=reason, from_step=at_step, to_step=to_step)
    return state, to_step
