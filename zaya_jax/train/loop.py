"""``zaya train``: the training driver, read top to bottom.

Each concern lives in its own module: the run directory (``rundir``), what each step trains on
(``schedule``), the compiled programs (``zaya_jax.programs``, called through ``programs``), what to
do after a bad step (``policy``), the components with a cadence of their own behind one interface
(``hooks``: logging, evaluation, checkpoints, profiling), metrics sinks (``metrics``). No state is
shared through closures: every helper returns what changed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from zaya_jax.config import Config
from zaya_jax.data import Prefetcher
from zaya_jax.optim import batch_lr_scale
from zaya_jax.parallel import put_batch
from zaya_jax.parallel.distributed import Launch, setup_runtime
from zaya_jax.programs import Programs, TrainState, build_programs
from zaya_jax.resilience import (
    LossGuard,
    NonFiniteLossError,
    RoutingAlarmError,
    RoutingMonitor,
    Watchdog,
    classify_runtime_error,
)
from zaya_jax.train.consensus import agree
from zaya_jax.train.flops import peak_flops
from zaya_jax.train.hooks import (
    Checkpointing,
    Evaluation,
    Hook,
    Logging,
    Profiling,
    RunContext,
    StepEnd,
    StopRequest,
)
from zaya_jax.train.init import initialize_from
from zaya_jax.train.metrics import MetricsWriter
from zaya_jax.train.policy import Action, Outcome, decide, decide_routing
from zaya_jax.train.programs import HeldOut, TrainStep
from zaya_jax.train.reference import preference_references
from zaya_jax.train.rewards import HeldOutReward
from zaya_jax.train.rollouts import Rollouts, kl_reference
from zaya_jax.train.rundir import RunDir
from zaya_jax.train.schedule import BatchProducer, check_run, final_batch_size
from zaya_jax.train.startup import start_event
from zaya_jax.train.throughput import Throughput


@dataclasses.dataclass
class _Resumed:
    """Where the loop starts: the state, the first step to run, what the events say about it."""

    state: TrainState
    first_step: int
    unreadable: list[dict[str, Any]]
    initialized: dict[str, Any] | None
    data_states: list[dict[str, Any]] | None = None  # the restored checkpoint's, one per saving process


@dataclasses.dataclass
class _Run:
    """A run's collaborators, set up by :func:`_open_run`; the loop holds no other state."""

    cfg: Config
    run: RunDir
    programs: Programs
    watchdog: Watchdog
    checkpoints: Checkpointing
    producer: BatchProducer | Rollouts
    writer: MetricsWriter
    resumed: _Resumed
    train_step: TrainStep
    meter: Throughput
    logging: Logging
    evaluation: Evaluation
    hooks: list[Hook]  # every hook, built-in first, in call order


def train(
    cfg: Config, *, progress: bool = True, hooks: Sequence[Hook] = (), launch: Launch | None = None
) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns a summary (final eval loss, time, throughput).

    The process is set up as ``zaya train`` sets it up (XLA flags, compilation cache,
    ``jax.distributed`` per ``launch`` or the scheduler), so a notebook's run is the command's.
    ``hooks`` run after the built-in ones at each step (:class:`zaya_jax.train.hooks.Hook`)."""
    start_time = time.perf_counter()
    setup_runtime(cfg.runtime, launch)
    r = _open_run(cfg, progress, hooks)
    batches = Prefetcher(r.producer, 0 if isinstance(r.producer, Rollouts) else cfg.data.prefetch)
    stop = StopRequest()
    try:
        step, data_state = _loop(r, batches, stop)
    except jax.errors.JaxRuntimeError as err:
        r.writer.event("device_error", **{"class": classify_runtime_error(err), "message": str(err)[:2000]})
        raise
    finally:
        r.watchdog.close()
        batches.close()
        stop.restore()
        for hook in r.hooks:
            hook.close()
        if sys.exc_info()[1] is not None:  # failing: close the sinks now, quietly (not at exit)
            r.writer.close(failing=True)

    wall = time.perf_counter() - start_time
    first = r.resumed.first_step
    summary = _summary(r.run, cfg, step, data_state, r.logging.last, r.evaluation.last_loss, wall, first)
    r.writer.event("end", **summary)
    r.writer.close()
    if jax.process_index() == 0 and first <= cfg.train.steps:
        r.run.write_summary(summary)
    return summary


def _open_run(cfg: Config, progress: bool, hooks: Sequence[Hook]) -> _Run:
    """The run directory, its programs, the state to start from, the sinks and the hooks."""
    primary = jax.process_index() == 0
    tokenizer = check_run(cfg)
    run, resuming = RunDir.open(cfg)
    programs = build_programs(cfg)
    resilience = cfg.resilience
    watchdog = Watchdog(run.path, resilience.hang_timeout_s, resilience.compile_timeout_s, enabled=primary)
    watchdog.beat(0, "restore" if resuming else "init")
    checkpoints = Checkpointing(cfg, run, watchdog)
    fresh = programs.init_state()
    resumed = _resume(cfg, run, resuming, fresh, checkpoints, primary)

    after = resumed.first_step - 1
    writer = MetricsWriter(run.path, cfg.train.steps if progress else None, primary, after, cfg)
    for detail in resumed.unreadable:
        writer.event("checkpoint_unreadable", **detail)
    if after > 0:
        writer.event("resume", from_step=after)
    if resumed.initialized:
        writer.event("init_from", **resumed.initialized)
    peak, peak_source = peak_flops(cfg.model.dtype)
    moe = programs.moe.record() if programs.moe is not None else None
    start_event(writer, cfg, programs.layout, peak, peak_source, after, resumed.initialized, moe)
    references = preference_references(
        cfg, run.path, programs, resumed.state, tokenizer, fresh_start=resumed.first_step == 1,
        event=writer.event, on_batch=lambda: watchdog.beat(0, "reference"),
    )  # fmt: skip
    meter = Throughput(peak)
    if cfg.train.objective == "grpo":
        producer: BatchProducer | Rollouts = Rollouts(cfg, tokenizer, kl_reference(cfg, programs, fresh))
        held_out: Any = HeldOutReward(cfg, tokenizer, producer.prompts, watchdog)
    else:
        producer = BatchProducer(cfg, tokenizer, references)
        held_out = HeldOut(programs, tokenizer, watchdog, references)
    if resumed.data_states is not None:
        producer.set_state(resumed.data_states)
    evaluation = Evaluation(held_out, cfg, writer, meter)
    logging = Logging(cfg, writer, meter, also_at=evaluation.due)
    every = [logging, evaluation, checkpoints, Profiling(cfg, run), *hooks]
    for hook in every:
        hook.start(RunContext(cfg, run, checkpoints, writer, primary))
    train_step = TrainStep(programs, watchdog, writer.event)
    return _Run(
        cfg, run, programs, watchdog, checkpoints, producer, writer, resumed, train_step, meter, logging,
        evaluation, every,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Drawn:
    """A batch as the data stream gave it (before the hooks): a step dispatched ahead and then
    discarded by a rollback decided on its predecessor trains the same batch again."""

    plan: Any
    host_batch: dict[str, Any]
    data_state: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """A step whose program is running (or done) and whose outcome has not been read yet."""

    step: int
    drawn: _Drawn
    metrics: dict[str, Any]
    limit: float


@dataclasses.dataclass(frozen=True)
class _Finished:
    """What reading a step's outcome decided: the step as the hooks saw it, or a rollback (the
    restored state and step), plus what every process agreed to do next."""

    end: StepEnd | None = None
    restored: tuple[TrainState, int] | None = None
    stop: str | None = None
    stopped_by: tuple[int, ...] = ()
    time_save: bool = False


def _loop(r: _Run, batches: Prefetcher, stop: StopRequest) -> tuple[int, dict[str, Any]]:
    """Steps from the first to ``train.steps`` (or to an agreed stop); returns the last step and
    the data position after it.

    With ``train.dispatch_ahead``, step t+1 is dispatched before step t's outcome is read, unless
    step t must be finished first (:func:`_finish_now`). A rollback decided from step t discards
    step t+1 (its batch is trained again after the restore); a stop or time-based save agreed at
    step t is acted on at step t+1, which is then finished before the next dispatch."""
    cfg = r.cfg
    ahead = cfg.train.dispatch_ahead
    guard, routing = LossGuard(cfg.resilience, lag=int(ahead)), RoutingMonitor(cfg)
    data_state = r.producer.get_state()  # read before the prefetch thread runs ahead of training
    state, step, end = r.resumed.state, r.resumed.first_step, None
    counts = {"skipped_steps": 0, "rollbacks": 0}
    pending: _Dispatched | None = None
    replay: _Drawn | None = None
    while step <= cfg.train.steps:
        drawn, replay = replay or _draw(r, batches, state), None
        state, current = _dispatch(r, step, state, drawn, guard)
        late = _Finished()
        if pending is not None:
            late = _finish(r, pending, None, state, guard, routing, counts, stop)
            pending = None
            if late.restored is not None:
                (state, to_step), replay = late.restored, drawn
                step = to_step + 1
                continue
            end, data_state = late.end, late.end.data_state
        if not ahead or late.stop or late.time_save or _finish_now(r, step):
            done = _finish(r, current, state, state, guard, routing, counts, stop, late.time_save)
            if done.restored is not None:
                state, to_step = done.restored
                step = to_step + 1
                continue
            end, data_state = done.end, done.end.data_state
            signalled = late if late.stop else done
            if signalled.stop:
                r.writer.event("stop", signal=signalled.stop, received_by=list(signalled.stopped_by))
                break
        else:
            pending = current
        step += 1
    if end is not None:
        for hook in r.hooks:
            hook.end_run(end)
    return min(step, cfg.train.steps), data_state


def _finish_now(r: _Run, step: int) -> bool:
    """Whether ``step`` is read before the next one is dispatched: the last step, a step whose
    state a hook reads (a save, an evaluation, the profile's end), and every GRPO step (its
    rollouts are sampled from the weights the step produced)."""
    last = step == r.cfg.train.steps
    return last or isinstance(r.producer, Rollouts) or any(hook.needs_state(step) for hook in r.hooks)


def _draw(r: _Run, batches: Prefetcher, state: TrainState) -> _Drawn:
    wait_start = time.perf_counter()
    r.producer.observe(state)  # GRPO samples its rollouts from the current weights
    plan, host_batch, data_state = next(batches)
    r.meter.data_wait += time.perf_counter() - wait_start
    return _Drawn(plan, host_batch, data_state)


def _dispatch(
    r: _Run, step: int, state: TrainState, drawn: _Drawn, guard: LossGuard
) -> tuple[TrainState, _Dispatched]:
    """Run the hooks' ``before_step`` and start step ``step``; returns its (future) state."""
    host_batch = drawn.host_batch
    for hook in r.hooks:
        host_batch = hook.before_step(step, host_batch)
    lr_scale = batch_lr_scale(drawn.plan.batch_size, final_batch_size(r.cfg), r.cfg.optim.lr_batch_scaling)
    limit = guard.limit(step)
    batch = put_batch(host_batch, r.programs.layout.batch)
    state, metrics = r.train_step(step, state, batch, lr_scale, limit)
    Outcome.prefetch(metrics)
    r.watchdog.beat(step)
    return state, _Dispatched(step, drawn, metrics, limit)


def _finish(
    r: _Run,
    done: _Dispatched,
    state: TrainState | None,
    latest: TrainState,
    guard: LossGuard,
    routing: RoutingMonitor,
    counts: dict[str, int],
    stop: StopRequest,
    time_save: bool = False,
) -> _Finished:
    """Read step ``done``'s outcome, act on it as every process agreed, run the hooks' ``after_step``.
    ``state`` is the state after the step (None: the next step has consumed it); ``latest`` the
    newest state (the template a rollback restores into); ``time_save`` a time-based save agreed
    at the previous step."""
    cfg, writer, step = r.cfg, r.writer, done.step
    outcome = Outcome.of(step, done.metrics, done.limit)
    decision = decide(outcome, cfg.resilience, counts["rollbacks"])
    alarm = routing.observe(step, done.metrics["routing"]) if decision.action is Action.ACCEPT else None
    if alarm is not None:
        decision = decide_routing(alarm, cfg.resilience, counts["rollbacks"])
        action = cfg.resilience.on_routing_alarm
        writer.event("routing_alarm", at_step=step, **alarm.detail(), action=action)
        if jax.process_index() == 0:
            print(f"zaya train: {alarm.message} (on_routing_alarm={action})", file=sys.stderr)
    time_due = any(hook.wants_save(step) for hook in r.hooks)
    timeout = cfg.runtime.barrier_timeout_s
    agreed = agree(step, time_due=time_due, stop=stop.requested, action=decision.action, timeout_s=timeout)
    if outcome.skipped:
        counts["skipped_steps"] += 1
        writer.event("skip", reason=outcome.reason, at_step=step, loss=outcome.loss, limit=done.limit)
    if decision.action is Action.STOP:
        raise (RoutingAlarmError if alarm else NonFiniteLossError)(decision.message)
    if decision.action is Action.ROLLBACK:
        restored, to_step = _rollback(r.checkpoints, writer, latest, decision.reason or outcome.reason, step)
        routing.reset()
        if to_step is not None:
            counts["rollbacks"] += 1
            return _Finished(restored=(restored, to_step))
    if decision.action is Action.ACCEPT:
        guard.accept(outcome.loss, step)

    last = step == cfg.train.steps
    end = StepEnd(
        step, state, done.drawn.data_state, done.metrics, done.drawn.plan, dict(counts), last,
        time_save or (agreed.time_save and state is not None),  # else taken at the next step
    )  # fmt: skip
    for hook in r.hooks:
        end = hook.after_step(end) or end
    writer.advance(r.logging.last)
    return _Finished(
        end, stop=agreed.stop, stopped_by=agreed.stopped_by, time_save=agreed.time_save and state is None
    )


def _resume(
    cfg: Config,
    run: RunDir,
    resuming: bool,
    fresh: TrainState,
    checkpoints: Checkpointing,
    primary: bool,
) -> _Resumed:
    """The latest readable checkpoint of a resumed run (with its data position), or, for a new run
    with ``train.init_from``, existing weights; else the fresh state."""
    restored, unreadable = checkpoints.restore(fresh) if resuming else (None, [])
    if restored is not None:
        state, data_states, restored_step = restored
        if primary:
            run.truncate_metrics(restored_step)  # before the writer opens the file
        return _Resumed(state, restored_step + 1, unreadable, None, data_states)
    if cfg.train.init_from:
        state, initialized = initialize_from(cfg.train.init_from, fresh)
        return _Resumed(state, 1, unreadable, initialized)
    return _Resumed(fresh, 1, unreadable, None)


def _rollback(
    checkpoints: Checkpointing, writer: MetricsWriter, state: TrainState, reason: str, at_step: int
) -> tuple[TrainState, int | None]:
    """Back to the last readable checkpoint: (its state, its step), or (``state``, None) when there
    is none (the bad update was only skipped). The data stream goes on: the window since is skipped."""
    restored, unreadable = checkpoints.restore(state)
    for detail in unreadable:
        writer.event("checkpoint_unreadable", **detail)
    if restored is None:
        writer.event("rollback_unavailable", reason=reason, at_step=at_step)
        return state, None
    state, _, to_step = restored
    writer.rewind(to_step)
    writer.event("rollback", reason=reason, from_step=at_step, to_step=to_step)
    return state, to_step


def _summary(
    run: RunDir,
    cfg: Config,
    step: int,
    data_state: dict[str, Any],
    last: dict[str, Any],
    eval_loss: float | None,
    wall: float,
    first_step: int,
) -> dict[str, Any]:
    """The run's summary; a run that was already complete keeps the one it has."""
    if first_step > cfg.train.steps and run.summary.is_file():
        try:
            return json.loads(run.summary.read_bytes())
        except ValueError:  # damaged: written again below
            pass
    return {
        "run_dir": str(run.path),
        "checkpoint": str(run.checkpoints / str(step)),
        "steps": step,
        "interrupted": step < cfg.train.steps,
        "tokens": data_state["tokens_seen"],
        "final_loss": last.get("loss"),
        "eval_loss": eval_loss,  # None: no step ran (already complete)
        "wall_time_s": wall,
    }
