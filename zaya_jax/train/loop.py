"""``zaya train``: the training driver, read top to bottom.

Each concern lives in its own module: the run directory (``rundir``), what the run trains for (its
objective's spec, :mod:`zaya_jax.objectives`: loss, producer, held-out evaluator), the compiled
programs (``zaya_jax.programs``, the train step through ``compiled``), dispatch ahead
(``pipeline``), a step's judge → agree → apply → notify (``steps``), what to do after a bad step
(``decisions``), evaluation and checkpoints (``evaluation``, ``checkpointing``), the observers
behind one interface (``hooks``: logging, profiling, the caller's), metrics sinks (``metrics``).
The loop names no objective: an ``lm`` run never enters reference, rollout or reward code. No
state is shared through closures: every helper returns what changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from zaya_jax.allocator import is_command, slow_path_warning
from zaya_jax.config import Config
from zaya_jax.data import Prefetcher
from zaya_jax.lora.plan import ParameterPlan
from zaya_jax.objectives import Evaluator, Producer, RunSetup, build_programs, spec_for
from zaya_jax.parallel import make_layout
from zaya_jax.parallel.distributed import Launch, setup_runtime
from zaya_jax.programs import TrainState
from zaya_jax.resilience import Watchdog, classify_runtime_error
from zaya_jax.resilience.goodput import Goodput
from zaya_jax.train.checkpointing import Checkpointing
from zaya_jax.train.compiled import TrainStep
from zaya_jax.train.consensus import StopRequest
from zaya_jax.train.evaluation import Evaluation
from zaya_jax.train.fit import check_state_fits
from zaya_jax.train.flops import peak_flops
from zaya_jax.train.health import NodeHealth
from zaya_jax.train.hooks import Hook, Logging, Profiling, RunContext
from zaya_jax.train.init import initialize_from, starting_weights
from zaya_jax.train.metrics import MetricsWriter
from zaya_jax.train.pipeline import StepPipeline
from zaya_jax.train.rundir import RunDir
from zaya_jax.train.schedule import check_run, largest_step
from zaya_jax.train.startup import start_event
from zaya_jax.train.steps import Collaborators, TrainingSteps
from zaya_jax.train.throughput import Throughput


@dataclasses.dataclass
class _Resumed:
    """Where the loop starts: the state, the first step to run, what the events say about it."""

    state: TrainState
    first_step: int
    unreadable: list[dict[str, Any]]
    initialized: dict[str, Any] | None
    data_states: list[dict[str, Any]] | None = None  # the restored checkpoint's, one per saving process
    position: dict[str, Any] | None = None  # the producer's, before its prefetch thread runs ahead


def train(
    cfg: Config, *, progress: bool = True, hooks: Sequence[Hook] = (), launch: Launch | None = None
) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns a summary (final eval loss, time, throughput).

    The process is set up as ``zaya train`` sets it up (XLA flags, compilation cache,
    ``jax.distributed`` per ``launch`` or the scheduler), so a notebook's run is the command's.
    ``hooks`` observe every step beside the built-in ones (:class:`zaya_jax.train.hooks.Hook`)."""
    start_time, started = time.perf_counter(), time.time()
    setup_runtime(cfg.runtime, launch)
    if is_command() and jax.default_backend() == "cpu" and jax.process_index() == 0:
        slow = slow_path_warning()
        if slow:  # the zaya command's steps would fault their buffers in afresh: one line, with the fix
            print(slow, file=sys.stderr, flush=True)
    run, resumed, r = _open_run(cfg, progress, hooks, started)
    stop = StopRequest()
    try:
        if resumed.first_step == 1:  # a resumed run logged its start already
            r.evaluation.at_start(resumed.state, r.writer)
        r.goodput.start_loop()
        ran = StepPipeline(TrainingSteps(r, stop), cfg.train.dispatch_ahead).run(
            resumed.state, resumed.first_step, cfg.train.steps
        )
        if ran.stopped is not None:
            r.writer.event("stop", signal=ran.stopped.stop, received_by=list(ran.stopped.stopped_by))
        if ran.last is not None:
            r.checkpoints.end_run(ran.last)
            for hook in r.hooks:
                hook.end_run(ran.last)
    except jax.errors.JaxRuntimeError as err:
        r.writer.event("device_error", **{"class": classify_runtime_error(err), "message": str(err)[:2000]})
        raise
    finally:
        for closing in (r.watchdog, r.health, r.batches):
            closing.close()
        _close(r.producer)
        stop.restore()
        for closing in (r.checkpoints, *r.hooks):
            closing.close()
        if sys.exc_info()[1] is not None:  # failing: close the sinks now, quietly (not at exit)
            r.writer.close(failing=True)

    last = ran.last
    summary = _summary(run, cfg, resumed.first_step, {
        "steps": ran.step,
        "interrupted": ran.step < cfg.train.steps,
        "tokens": (last.data_state if last is not None else resumed.position)["tokens_seen"],
        "final_loss": _finite(r.writer.last.get("loss")),  # None: not a number (JSON has no NaN)
        "eval_loss": _finite(last.eval_loss if last is not None else None),  # None also: no step ran
        "wall_time_s": time.perf_counter() - start_time,
        "goodput": r.goodput.finish(last.step if last is not None else None),  # over every attempt
    })  # fmt: skip
    r.writer.event("end", **summary)
    r.writer.close()
    if jax.process_index() == 0 and resumed.first_step <= cfg.train.steps:
        run.write_summary(summary)
    r.health.after_run(ran.step)  # a drained run ends as one (exit 76), its last step saved
    return summary


def _open_run(
    cfg: Config, progress: bool, hooks: Sequence[Hook], started: float
) -> tuple[RunDir, _Resumed, Collaborators]:
    """The run directory, its programs, the state to start from, the sinks, the objective's
    producer and evaluator, and the hooks."""
    primary = jax.process_index() == 0
    tokenizer = check_run(cfg)
    layout = make_layout(cfg)
    check_state_fits(cfg, layout)  # in seconds, before anything is measured, compiled, allocated or written
    run, resuming = RunDir.open(cfg)
    programs = build_programs(cfg, layout)
    with contextlib.ExitStack() as cleanup:  # undone only when setting up fails: the loop owns them after
        health = NodeHealth.start(cfg, run.path, programs.abstract_state)  # or refuse, before compiling
        cleanup.callback(health.close)
        resilience = cfg.resilience
        watchdog = Watchdog(
            run.path, resilience.hang_timeout_s, resilience.compile_timeout_s, enabled=primary,
            collective_timeout_s=cfg.runtime.collective_timeout_s, on_collective_timeout=resilience.on_unhealthy,
        )  # fmt: skip
        cleanup.callback(watchdog.close)  # a watchdog left running would end this process later
        train_step = TrainStep(programs, watchdog)
        train_step.compile(*largest_step(cfg))  # the run's largest step fits, or stop
        watchdog.beat(0, "restore" if resuming else "init")
        checkpoints = Checkpointing(cfg, run, watchdog, programs.layout.parameters)
        cleanup.callback(checkpoints.close)
        fresh = programs.init_state()
        resumed = _resume(cfg, run, resuming, fresh, checkpoints, programs.layout.parameters)
        goodput = Goodput(run.path, started, primary=primary).resumed(resumed.first_step - 1)

        after = resumed.first_step - 1
        writer = MetricsWriter(run.path, cfg.train.steps if progress else None, primary, after, cfg)
        cleanup.callback(writer.close, failing=True)
        for detail in resumed.unreadable:
            writer.event("checkpoint_unreadable", **detail)
        if after > 0:
            writer.event("resume", from_step=after, tier=checkpoints.restored_tier)
        if resumed.initialized:
            writer.event("init_from", **resumed.initialized)
        peak, peak_source = peak_flops(cfg.model.dtype)
        moe = programs.moe.record() if programs.moe is not None else None
        start_event(writer, cfg, programs.layout, peak, peak_source, after, resumed.initialized, moe)
        train_step.attach(writer.event, goodput.add)
        setup = RunSetup(
            cfg, run.path, programs, tokenizer, resumed.state, resumed.first_step == 1,
            lambda: starting_weights(cfg, fresh, programs.layout.parameters), writer.event, watchdog.beat,
        )  # fmt: skip
        producer, held_out = _objective_parts(setup)
        cleanup.callback(_close, producer)  # a producer sampling ahead has a thread to stop
        if resumed.data_states is not None:
            producer.set_state(resumed.data_states)
            if hasattr(producer, "resume_ahead"):
                producer.resume_ahead(functools.partial(checkpoints.restore_ahead, resumed.state))
        resumed.position = producer.get_state()
        meter = Throughput(peak)
        every = [Logging(cfg, writer, meter), Profiling(cfg, run), *hooks]
        for hook in every:
            hook.start(RunContext(cfg, run, checkpoints, writer, primary, health))
        batches = Prefetcher(producer, producer.prefetch)
        collaborators = Collaborators(
            cfg, programs, train_step, producer, batches, watchdog, writer, meter,
            Evaluation(held_out, cfg, meter, goodput.add), checkpoints, every, health, goodput,
        )  # fmt: skip
        cleanup.pop_all()
    return run, resumed, collaborators


def _close(producer: Producer) -> None:
    """The producer's optional ``close`` (see :class:`~zaya_jax.objectives.Producer`)."""
    if hasattr(producer, "close"):
        producer.close()


def _objective_parts(setup: RunSetup) -> tuple[Producer, Evaluator]:
    """The run's producer and held-out evaluator, from its objective's spec (after the spec's
    preparation, e.g. dpo's reference pass)."""
    spec = spec_for(setup.cfg)
    prepared = spec.prepare(setup)
    return spec.producer(setup, prepared), spec.held_out(setup, prepared)


def _resume(
    cfg: Config,
    run: RunDir,
    resuming: bool,
    fresh: TrainState,
    checkpoints: Checkpointing,
    parameters: ParameterPlan,
) -> _Resumed:
    """The latest readable checkpoint of a resumed run (with its data position), or, for a new run
    with ``train.init_from``, existing weights; else the fresh state. With a frozen base
    (``parameters``) the checkpoints hold what trains only: the base is loaded first, and checked
    against theirs."""
    based = None
    if resuming and parameters.frozen_base:
        based = initialize_from(cfg.train.init_from, fresh, parameters)
        fresh = based[0]
    restored, unreadable = checkpoints.restore(fresh) if resuming else (None, [])
    if resuming:  # refused when the curriculum changed where the run has trained
        run.continue_with(cfg, restored and int(restored[1][0].get("tokens_seen", 0)))
    if restored is not None:
        state, data_states, restored_step = restored
        if jax.process_index() == 0:
            run.truncate_metrics(restored_step)  # before the writer opens the file
        return _Resumed(state, restored_step + 1, unreadable, None, data_states)
    if cfg.train.init_from:
        state, initialized = based or initialize_from(cfg.train.init_from, fresh, parameters)
        return _Resumed(state, 1, unreadable, initialized)
    return _Resumed(fresh, 1, unreadable, None)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _summary(run: RunDir, cfg: Config, first_step: int, fields: dict[str, Any]) -> dict[str, Any]:
    """The run's summary: where it is and ``fields``; a run that was already complete keeps the
    one it has."""
    if first_step > cfg.train.steps and run.summary.is_file():
        try:
            return json.loads(run.summary.read_bytes())
        except ValueError:  # damaged: written again below
            pass
    return {"run_dir": str(run.path), "checkpoint": str(run.checkpoints / str(fields["steps"])), **fields}
