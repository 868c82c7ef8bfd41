"""``zaya train``: the training driver, read top to bottom.

Each concern lives in its own module: the run directory (``rundir``), what each step trains on
(``schedule``), the compiled programs (``programs``), the pure step (``step``), what to do after a
bad step (``policy``), checkpoint cadence and fault injection (``hooks``), metrics (``metrics``).
No state is shared through closures: every helper returns what changed.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import jax

from zaya_jax.config import Config
from zaya_jax.data import Prefetcher
from zaya_jax.optim import batch_lr_scale, build_optimizer, current_learning_rates, model_param_groups
from zaya_jax.parallel import make_layout, put_batch
from zaya_jax.resilience import LossGuard, NonFiniteLossError, Watchdog, classify_runtime_error
from zaya_jax.train.consensus import agree
from zaya_jax.train.flops import flops_per_token, peak_flops
from zaya_jax.train.hooks import Checkpointing, FaultHook, ProfileHook, StepEnd, StopRequest
from zaya_jax.train.init import initialize_from
from zaya_jax.train.metrics import MetricsWriter, Throughput, metric_record, start_event
from zaya_jax.train.policy import Action, Outcome, decide
from zaya_jax.train.programs import HeldOut, TrainStep
from zaya_jax.train.rundir import RunDir
from zaya_jax.train.schedule import BatchProducer, check_run, final_batch_size
from zaya_jax.train.step import TrainState, init_sharded_train_state


def train(cfg: Config, *, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns a summary (final eval loss, time, throughput)."""
    start_time = time.perf_counter()
    primary = jax.process_index() == 0

    # --- The run: directory, layout, optimizer, state ---------------------------------------------
    tokenizer = check_run(cfg)
    run, resuming = RunDir.open(cfg)
    layout = make_layout(cfg)
    groups = model_param_groups(cfg.model, cfg.optim.router_group)
    tx = build_optimizer(cfg.optim, groups, cfg.train.steps, shardings=layout.variables["params"])
    state, shardings = init_sharded_train_state(cfg, tx, layout)
    resilience = cfg.resilience
    watchdog = Watchdog(run.path, resilience.hang_timeout_s, resilience.compile_timeout_s, enabled=primary)
    watchdog.beat(0, "restore" if resuming else "init")
    checkpoints = Checkpointing(cfg, run, watchdog)
    hooks = [checkpoints, FaultHook(cfg, run, checkpoints, primary=primary), ProfileHook(cfg, run)]
    producer = BatchProducer(cfg, tokenizer)

    # --- Resume from the latest readable checkpoint -------------------------------------------------
    restored, unreadable = checkpoints.restore(state) if resuming else (None, [])
    initialized = None
    if restored is not None:
        state, data_state, restored_step = restored
        producer.set_state(data_state)
        if primary:
            run.truncate_metrics(restored_step)  # before the writer opens the file
    elif cfg.train.init_from:  # a fresh run from existing weights
        state, initialized = initialize_from(cfg.train.init_from, state)
    first_step = checkpoints.saved_step + 1
    writer = MetricsWriter(run.path, cfg.train.steps if progress else None, primary, first_step - 1, cfg)
    for detail in unreadable:
        writer.event("checkpoint_unreadable", **detail)
    if first_step > 1:
        writer.event("resume", from_step=first_step - 1)
    if initialized:
        writer.event("init_from", **initialized)

    # --- Compiled programs ----------------------------------------------------------------------------
    train_step = TrainStep(cfg, tx, layout, shardings, watchdog)
    held_out = HeldOut(cfg, tokenizer, layout, shardings, watchdog)
    peak, peak_source = peak_flops(cfg.model.dtype)
    start_event(writer, cfg, layout, peak, peak_source, first_step - 1, initialized)

    # --- The loop ---------------------------------------------------------------------------------------
    stop, guard, meter = StopRequest(), LossGuard(resilience), Throughput(peak)
    data_state = producer.get_state()  # read before the prefetch thread runs ahead of training
    batches = Prefetcher(producer, cfg.data.prefetch)
    eval_loss, step_eval, last, skipped_steps, rollbacks = math.nan, None, {}, 0, 0
    step = first_step
    try:
        while step <= cfg.train.steps:
            wait_start = time.perf_counter()
            plan, host_batch, data_state = next(batches)
            meter.data_wait += time.perf_counter() - wait_start
            for hook in hooks:
                host_batch = hook.before_step(step, host_batch)
            lr_scale = batch_lr_scale(plan.batch_size, final_batch_size(cfg), cfg.optim.lr_batch_scaling)
            limit = guard.limit()
            state, metrics = train_step(step, state, put_batch(host_batch, layout.batch), lr_scale, limit)
            meter.add(plan.tokens, plan.tokens * flops_per_token(cfg.model, plan.seq_len))
            watchdog.beat(step)

            outcome = Outcome.of(step, metrics, limit)
            decision = decide(outcome, resilience, rollbacks)
            agreed = agree(step, time_due=checkpoints.time_due(), stop=stop.requested, action=decision.action)
            if outcome.skipped:
                skipped_steps += 1
                writer.event("skip", reason=outcome.reason, at_step=step, loss=outcome.loss, limit=limit)
            if decision.action is Action.STOP:
                raise NonFiniteLossError(decision.message)
            if decision.action is Action.ROLLBACK:
                state, to_step = _rollback(checkpoints, writer, state, outcome)
                if to_step is not None:
                    rollbacks, step = rollbacks + 1, to_step + 1
                    continue
            if decision.action is Action.ACCEPT:
                guard.accept(outcome.loss)

            is_eval = step % cfg.train.eval_every == 0 or step == cfg.train.steps
            if step % cfg.train.log_every == 0 or is_eval:
                lrs = current_learning_rates(state.opt_state)
                counts = {"skipped_steps": skipped_steps, "rollbacks": rollbacks}
                last = metric_record(step, metrics, lr=lrs["adam_lr"], muon_lr=lrs["muon_lr"], **meter.fields(),
                                     tokens_seen=data_state["tokens_seen"], **plan.fields(), **counts)  # fmt: skip
                writer.write(last)
                meter.reset()
            step_eval = None
            if is_eval:
                eval_start = time.perf_counter()
                eval_loss = step_eval = held_out(step, state)
                meter.pause(time.perf_counter() - eval_start)
                writer.write({"step": step, "eval_loss": eval_loss})
            writer.advance(last)
            end = StepEnd(step, state, data_state, step == cfg.train.steps, agreed.time_save, step_eval)
            for hook in hooks:
                hook.after_step(end)
            if agreed.stop:
                writer.event("stop", signal=agreed.stop, received_by=list(agreed.stopped_by))
                break
            step += 1
        step = min(step, cfg.train.steps)
        if step != checkpoints.saved_step:
            checkpoints.save(step, state, data_state, step_eval)
        checkpoints.finish()
    except jax.errors.JaxRuntimeError as err:
        writer.event("device_error", **{"class": classify_runtime_error(err), "message": str(err)[:2000]})
        raise
    finally:
        watchdog.close()
        batches.close()
        stop.restore()
        checkpoints.close()
        if sys.exc_info()[1] is not None:  # failing: close the sinks now, quietly (not at exit)
            writer.close(failing=True)

    # --- Summary ------------------------------------------------------------------------------------------
    summary = _summary(
        run, cfg, step, data_state, last, eval_loss, time.perf_counter() - start_time, first_step
    )
    writer.event("end", **summary)
    writer.close()
    if primary and first_step <= cfg.train.steps:
        run.write_summary(summary)
    return summary


def _rollback(
    checkpoints: Checkpointing, writer: MetricsWriter, state: TrainState, outcome: Outcome
) -> tuple[TrainState, int | None]:
    """Back to the last readable checkpoint: (its state, its step), or (``state``, None) when there
    is none (the bad update was only skipped). The data stream goes on: the window since is skipped."""
    restored, unreadable = checkpoints.restore(state)
    for detail in unreadable:
        writer.event("checkpoint_unreadable", **detail)
    if restored is None:
        writer.event("rollback_unavailable", reason=outcome.reason, at_step=outcome.step)
        return state, None
    state, _, to_step = restored
    writer.rewind(to_step)
    writer.event("rollback", reason=outcome.reason, from_step=outcome.step, to_step=to_step)
    return state, to_step


def _summary(
    run: RunDir,
    cfg: Config,
    step: int,
    data_state: dict[str, Any],
    last: dict[str, Any],
    eval_loss: float,
    wall: float,
    first_step: int,
) -> dict[str, Any]:
    """The run's summary; a run that was already complete keeps the one it has."""
    if first_step > cfg.train.steps and run.summary.is_file():
        return json.loads(run.summary.read_text())
    return {
        "run_dir": str(run.path),
        "checkpoint": str(run.checkpoints / str(step)),
        "steps": step,
        "interrupted": step < cfg.train.steps,
        "tokens": data_state["tokens_seen"],
        "final_loss": last.get("loss"),
        "eval_loss": eval_loss if math.isfinite(eval_loss) else None,  # None: no step ran (already complete)
        "wall_time_s": wall,
    }
