"""The training loop behind ``zaya train``: data plan (batch ramp, curriculum stages), the jitted
step, metrics (``metrics.jsonl``, TensorBoard, progress bar), periodic held-out evaluation."""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from zaya_jax import checkpoint
from zaya_jax.config import Config, ConfigError, load_config, save_config, to_dict
from zaya_jax.data import Prefetcher, eval_batches, load_tokenizer, make_row_iterator, next_batch
from zaya_jax.optim import (
    batch_lr_scale,
    build_optimizer,
    current_learning_rates,
    model_param_groups,
    set_lr_scale,
)
from zaya_jax.parallel import make_layout, put_batch
from zaya_jax.parallel.distributed import barrier
from zaya_jax.resilience import (
    Faults,
    LossGuard,
    NonFiniteLossError,
    Watchdog,
    classify_runtime_error,
    corrupt_checkpoint,
)
from zaya_jax.train.flops import flops_per_token, peak_flops
from zaya_jax.train.metrics import MetricsWriter
from zaya_jax.train.step import TrainState, init_sharded_train_state, make_eval_step, make_train_step


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step trains on: ``batch_size`` rows of ``seq_len`` from curriculum ``stage``."""

    batch_size: int
    seq_len: int
    stage: int
    mixture: tuple[float, ...] | None


def plan_for(cfg: Config, tokens_seen: int) -> StepPlan:
    """The batch ramp and curriculum stage in force after ``tokens_seen`` training tokens."""
    train = cfg.train
    batch_size = train.batch_size
    thresholds = [p.tokens for p in train.batch_ramp]
    index = bisect.bisect_right(thresholds, tokens_seen) - 1
    if index >= 0:
        batch_size = train.batch_ramp[index].batch_size
    if not train.stages:
        return StepPlan(batch_size, train.seq_len, 0, None)
    boundaries = np.cumsum([s.tokens for s in train.stages])
    stage = min(int(np.searchsorted(boundaries, tokens_seen, side="right")), len(train.stages) - 1)
    return StepPlan(batch_size, train.stages[stage].seq_len, stage, train.stages[stage].mixture)


class _StopRequest:
    """SIGTERM/SIGINT handling: the first signal asks the loop to save a checkpoint and exit."""

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


def final_batch_size(cfg: Config) -> int:
    return cfg.train.batch_ramp[-1].batch_size if cfg.train.batch_ramp else cfg.train.batch_size


def prepare_run_dir(cfg: Config) -> tuple[Path, bool]:
    """Create ``runs/<name>/`` and write the resolved config. Returns (run_dir, resuming).

    A directory holding training checkpoints is resumed; any other non-empty directory is refused,
    so nothing already saved is overwritten.
    """
    run_dir = cfg.run.path
    checkpoints = run_dir / checkpoint.CHECKPOINTS
    resuming = checkpoints.is_dir() and any((p / "train").is_dir() for p in checkpoints.iterdir())
    if not resuming and _crashed_before_first_checkpoint(run_dir, cfg):
        _truncate_metrics(run_dir, 0)  # its logged steps are re-run from scratch
        return run_dir, False
    # events.jsonl alone is a supervisor's log from before the trainer's first start
    if not resuming and run_dir.exists() and any(p.name != "events.jsonl" for p in run_dir.iterdir()):
        raise FileExistsError(
            f"run directory {run_dir} already holds a run without training checkpoints to resume from; "
            "choose another run.name (or run.dir) or move the old run away"
        )
    if resuming and (run_dir / "config.yaml").is_file():
        saved = load_config(run_dir / "config.yaml")
        if saved.model != cfg.model:
            raise ConfigError(
                f"{run_dir} was trained with a different model config; resume with the same model.* "
                "values (see its config.yaml) or choose another run.name"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir, resuming


def _crashed_before_first_checkpoint(run_dir: Path, cfg: Config) -> bool:
    """A run of this very config that died before saving anything: only its logs are there, so
    starting it again loses nothing (a supervisor restarting it must not be refused)."""
    saved = run_dir / "config.yaml"
    checkpoints = run_dir / checkpoint.CHECKPOINTS
    if not saved.is_file() or (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        return False  # committed checkpoints (model-only ones included) are never started over
    try:
        return load_config(saved) == cfg
    except (ConfigError, ValueError):
        return False


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metric lines logged after ``step`` (the steps a resumed run repeats), atomically."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
    ]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


class BatchProducer:
    """Produces (plan, host batch) step after step, following the batch ramp and curriculum.

    Runs on the prefetch thread, ahead of training; the plan depends only on tokens already
    produced, so it is the same whether or not batches are prefetched.
    """

    def __init__(self, cfg: Config, tokenizer: Any):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tokens_seen = 0
        self.rows, self.stage = None, -1

    def _open_stage(self, plan: StepPlan) -> None:
        self.rows = make_row_iterator(
            self.cfg.data,
            self.tokenizer,
            seq_len=plan.seq_len,
            seed=self.cfg.train.seed + plan.stage,
            mixture=plan.mixture,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        self.stage = plan.stage

    def get_state(self) -> dict[str, Any]:
        """The data position after the last batch produced (JSON-able)."""
        rows = self.rows.get_state() if self.rows is not None else None
        return {"tokens_seen": self.tokens_seen, "stage": self.stage, "rows": rows}

    def set_state(self, state: dict[str, Any]) -> None:
        self.tokens_seen = int(state["tokens_seen"])
        self.rows, self.stage = None, -1
        if state["rows"] is not None:
            stage = int(state["stage"])
            stages = self.cfg.train.stages
            seq_len = stages[stage].seq_len if stages else self.cfg.train.seq_len
            mixture = stages[stage].mixture if stages else None
            self._open_stage(StepPlan(0, seq_len, stage, mixture))
            self.rows.set_state(state["rows"])

    def __call__(self) -> tuple[StepPlan, dict[str, np.ndarray], dict[str, Any]]:
        plan = plan_for(self.cfg, self.tokens_seen)
        if plan.stage != self.stage:  # a new curriculum stage: new sequence length and mixture
            self._open_stage(plan)
        self.tokens_seen += plan.batch_size * plan.seq_len  # global tokens, all processes together
        batch = next_batch(self.rows, plan.batch_size // jax.process_count())  # this process's rows
        return plan, batch, self.get_state()


def train(cfg: Config, *, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns a summary (final eval loss, time, throughput)."""
    start_time = time.perf_counter()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size}"
        )
    primary = jax.process_index() == 0
    if primary:
        run_dir, resuming = prepare_run_dir(cfg)
    if jax.process_count() > 1:  # the other processes follow the first one's decision
        run_dir = cfg.run.path
        resuming = bool(multihost_utils.broadcast_one_to_all(np.int32(resuming if primary else 0)))

    layout = make_layout(cfg)
    tx = build_optimizer(
        cfg.optim,
        model_param_groups(cfg.model, cfg.optim.router_group),
        cfg.train.steps,
        shardings=layout.variables["params"],
    )
    state, state_shardings = init_sharded_train_state(cfg, tx, layout)
    producer = BatchProducer(cfg, tokenizer)
    ckpt = cfg.checkpoint
    saver = checkpoint.TrainingSaver(
        run_dir / checkpoint.CHECKPOINTS,
        async_save=ckpt.async_save,
        keep=ckpt.keep,
        keep_every=ckpt.keep_every,
    )
    first_step = 1
    watchdog = Watchdog(
        run_dir, cfg.resilience.hang_timeout_s, cfg.resilience.compile_timeout_s, enabled=primary
    )
    watchdog.beat(0, "restore" if resuming else "init")
    faults = Faults(cfg.debug, run_dir, primary=primary)
    unreadable: list[dict[str, Any]] = []

    def skip_unreadable(step: int, err: BaseException, moved: Path) -> None:
        unreadable.append(
            {
                "event": "checkpoint_unreadable",
                "checkpoint": step,
                "error": str(err)[:500],
                "moved_to": str(moved),
            }
        )

    if resuming:
        restored = checkpoint.restore_training(run_dir / checkpoint.CHECKPOINTS, state, skip_unreadable)
        if restored is not None:
            state, data_state, restored_step = restored
            producer.set_state(data_state)
            first_step = restored_step + 1
            if primary:
                _truncate_metrics(run_dir, restored_step)  # before the writer opens the file
    writer = MetricsWriter(run_dir, progress_total=cfg.train.steps if progress else None, enabled=primary)
    if unreadable:
        saver.reload()  # their step numbers are free again
    for event in unreadable:
        writer.event(event)
    unreadable.clear()
    if first_step > 1:
        writer.event({"event": "resume", "from_step": first_step - 1})
    step_fn = jax.jit(
        make_train_step(cfg, tx, set_lr_scale, **layout.step_hooks),
        in_shardings=(state_shardings, layout.batch, layout.replicated, layout.replicated),
        out_shardings=(state_shardings, layout.replicated),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        make_eval_step(cfg, **layout.step_hooks),
        in_shardings=(state_shardings.params, state_shardings.balancing, layout.batch),
        out_shardings=layout.replicated,
    )
    held_out = [
        put_batch(_local_rows(b), layout.batch)
        for b in eval_batches(
            cfg.data,
            tokenizer,
            seq_len=cfg.train.seq_len,
            batch_size=cfg.train.batch_size,
            num_batches=cfg.train.eval_batches,
            seed=cfg.train.seed,
        )
    ]

    # Compiled ahead of the first call, then every process waits at a barrier: on CPU (gloo) a
    # process still compiling would otherwise trip its peers' collective timeout.
    compiled_steps: dict[tuple[int, int], Any] = {}
    compiled_eval: list[Any] = []

    def evaluate(state: TrainState) -> float:
        total, count = 0.0, 0.0
        watchdog.beat(step, "eval" if compiled_eval else "compile")
        if not compiled_eval:
            compiled_eval.append(eval_fn.lower(state.params, state.balancing, held_out[0]).compile())
            barrier("eval", cfg.runtime.barrier_timeout_s)
        for batch in held_out:
            ce, n = compiled_eval[0](state.params, state.balancing, batch)
            total, count = total + float(ce), count + float(n)
        return total / max(count, 1.0)

    peak, peak_source = peak_flops(cfg.model.dtype)
    writer.event(
        {
            "event": "start",
            "peak_flops": peak,
            "peak_source": peak_source,
            "devices": jax.device_count(),
            "mesh": layout.describe(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "runtime": to_dict(cfg.runtime),
        }
    )
    stop = _StopRequest()
    # Read the producer before its prefetch thread starts: afterwards it runs ahead of training.
    tokens_seen, data_state = producer.tokens_seen, producer.get_state()
    batches = Prefetcher(producer, cfg.data.prefetch)
    interval_tokens, interval_flops, data_wait = 0, 0.0, 0.0
    interval_start = time.perf_counter()
    eval_loss = math.nan
    last: dict[str, Any] = {}
    step = saved_step = first_step - 1  # a resumed run's restored step is already saved
    last_save = time.monotonic()
    guard = LossGuard(cfg.resilience)
    skipped_steps = rollbacks = 0

    def rollback(bad_step: int, reason: str) -> int | None:
        """Back to the last checkpoint; the data stream goes on (the window since is skipped).
        Returns the checkpoint's step, or None when there is none (the update was skipped only)."""
        nonlocal state, rollbacks
        saver.finish()
        restored = checkpoint.restore_training(run_dir / checkpoint.CHECKPOINTS, state, skip_unreadable)
        saver.reload()
        for event in unreadable:
            writer.event(event)
        unreadable.clear()
        if restored is None:
            writer.event({"event": "rollback_unavailable", "reason": reason, "at_step": bad_step})
            return None
        rollbacks += 1
        if rollbacks > cfg.resilience.max_rollbacks:
            raise NonFiniteLossError(
                f"step {bad_step}: {reason}, and {cfg.resilience.max_rollbacks} rollbacks already "
                "(resilience.max_rollbacks); the data or the settings keep producing bad steps"
            )
        state, _, to_step = restored
        writer.rewind(to_step)
        writer.event({"event": "rollback", "reason": reason, "from_step": bad_step, "to_step": to_step})
        return to_step

    try:
        step = first_step
        while step <= cfg.train.steps:
            wait_start = time.perf_counter()
            plan, host_batch, data_state = next(batches)
            data_wait += time.perf_counter() - wait_start
            batch = put_batch(host_batch, layout.batch)
            lr_scale = batch_lr_scale(plan.batch_size, final_batch_size(cfg), cfg.optim.lr_batch_scaling)
            lr_scale = jnp.asarray(lr_scale, jnp.float32)
            poison = math.nan if faults.due("nan_at_step", step) else 1.0
            guard_in = jnp.asarray([guard.limit(), poison], jnp.float32)
            shape = (plan.batch_size, plan.seq_len)
            if shape not in compiled_steps:
                watchdog.beat(step - 1, "compile")
                compiled_steps[shape] = step_fn.lower(state, batch, lr_scale, guard_in).compile()
                barrier(f"step {shape}", cfg.runtime.barrier_timeout_s)
            state, metrics = compiled_steps[shape](state, batch, lr_scale, guard_in)
            step_tokens = plan.batch_size * plan.seq_len
            tokens_seen = data_state["tokens_seen"]  # the producer's count after this batch
            interval_tokens += step_tokens
            interval_flops += step_tokens * flops_per_token(cfg.model, plan.seq_len)
            watchdog.beat(step)

            skipped, nonfinite, loss = (float(x) for x in jax.device_get(
                (metrics["skipped"], metrics["nonfinite"], metrics["loss"])
            ))  # fmt: skip
            if skipped:
                skipped_steps += 1
                reason = "nonfinite" if nonfinite else "spike"
                writer.event(
                    {"event": "skip", "reason": reason, "at_step": step, "loss": loss, "limit": guard.limit()}
                )
                action = cfg.resilience.on_nonfinite if nonfinite else cfg.resilience.on_spike
                if action == "stop":
                    raise NonFiniteLossError(
                        f"step {step}: non-finite loss or gradients (loss {loss}); resilience.on_nonfinite=stop. "
                        f"Resume from the last checkpoint, or set resilience.on_nonfinite=skip or rollback"
                    )
                if action == "rollback":
                    to_step = rollback(step, reason)
                    if to_step is not None:
                        saved_step, step = to_step, to_step + 1
                        continue
            else:
                guard.accept(loss)

            is_eval = step % cfg.train.eval_every == 0 or step == cfg.train.steps
            if step % cfg.train.log_every == 0 or is_eval:
                metrics = jax.device_get(metrics)
                elapsed = time.perf_counter() - interval_start
                lrs = current_learning_rates(state.opt_state)
                last = {
                    "step": step,
                    "loss": float(metrics["loss"]),
                    "lr": float(lrs["adam_lr"]),
                    "muon_lr": float(lrs["muon_lr"]),
                    "grad_norm": float(metrics["grad_norm"]),
                    "tokens_per_s": interval_tokens / elapsed,
                    "mfu": interval_flops / elapsed / peak if math.isfinite(peak) else None,
                    "tokens_seen": tokens_seen,
                    "batch_size": plan.batch_size,
                    "seq_len": plan.seq_len,
                    "stage": plan.stage,
                    "data_wait_s": data_wait,
                    "z_loss": float(metrics["z_loss"]),
                    "expert_load": [round(float(x), 4) for x in metrics["expert_load"]],
                    "max_min_load_ratio": float(metrics["max_min_load_ratio"]),
                    "skip_fraction": float(metrics["skip_fraction"]),
                    "dropped_tokens": float(metrics["dropped_tokens"]),
                    "bias_mean": float(metrics["bias_mean"]),
                    "bias_std": float(metrics["bias_std"]),
                    "bias_skip": float(metrics["bias_skip"]),
                    "router_prob_spread": float(metrics["router_prob_spread"]),
                    "skipped_steps": skipped_steps,
                    "rollbacks": rollbacks,
                }
                writer.write(last)
                interval_tokens, interval_flops, data_wait = 0, 0.0, 0.0
                interval_start = time.perf_counter()
            if is_eval:
                eval_start = time.perf_counter()
                eval_loss = evaluate(state)
                interval_start += time.perf_counter() - eval_start  # tokens/s counts training time only
                writer.write({"step": step, "eval_loss": eval_loss})
            writer.advance(last)
            due = (ckpt.every_steps and step % ckpt.every_steps == 0) or (
                ckpt.every_minutes and time.monotonic() - last_save >= 60 * ckpt.every_minutes
            )
            if due and step != cfg.train.steps:
                watchdog.beat(step, "save")
                saver.save(step, cfg, state, data_state)
                saved_step, last_save = step, time.monotonic()
                if faults.due("crash_during_save_at_step", step):
                    faults.crash()  # the save is still being written in the background
                if faults.due("corrupt_checkpoint_at_step", step):
                    saver.finish()
                    corrupt_checkpoint(run_dir / checkpoint.CHECKPOINTS / str(step))
            else:
                saver.check()  # a save that failed in the background stops the run here
            if faults.due("crash_at_step", step):
                faults.crash()
            if faults.due("hang_at_step", step):
                faults.hang()
            if stop.requested:
                writer.event({"event": "stop", "signal": stop.requested})
                break
            step += 1
        step = min(step, cfg.train.steps)
        if step != saved_step:
            watchdog.beat(step, "save")
            saver.save(step, cfg, state, data_state)
        saver.finish()
    except jax.errors.JaxRuntimeError as err:
        writer.event(
            {"event": "device_error", "class": classify_runtime_error(err), "message": str(err)[:2000]}
        )
        raise
    finally:
        watchdog.close()
        batches.close()
        stop.restore()
        saver.close()
    step_dir = run_dir / checkpoint.CHECKPOINTS / str(step)
    summary = {
        "run_dir": str(run_dir),
        "checkpoint": str(step_dir),
        "steps": step,
        "interrupted": step < cfg.train.steps,
        "tokens": tokens_seen,
        "final_loss": last.get("loss"),
        "eval_loss": eval_loss if math.isfinite(eval_loss) else None,  # None: no step ran (already complete)
        "wall_time_s": time.perf_counter() - start_time,
    }
    writer.event({"event": "end", **summary})
    writer.close()
    if primary:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's share of a global host batch (all of it in a single-process run)."""
    count, index = jax.process_count(), jax.process_index()
    rows = next(iter(batch.values())).shape[0] // count
    return {k: v[index * rows : (index + 1) * rows] for k, v in batch.items()}
