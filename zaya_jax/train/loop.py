"""The training loop behind ``zaya train``: data plan (batch ramp, curriculum stages), the jitted
step, metrics (``metrics.jsonl``, TensorBoard, progress bar), periodic held-out evaluation."""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax import checkpoint
from zaya_jax.config import Config, ConfigError, save_config
from zaya_jax.data import Prefetcher, eval_batches, load_tokenizer, make_row_iterator, next_batch
from zaya_jax.model import BALANCING, init_variables
from zaya_jax.optim import (
    batch_lr_scale,
    build_optimizer,
    current_learning_rates,
    model_param_groups,
    set_lr_scale,
)
from zaya_jax.train.flops import flops_per_token, peak_flops
from zaya_jax.train.metrics import MetricsWriter
from zaya_jax.train.step import TrainState, init_train_state, make_eval_step, make_train_step


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


def final_batch_size(cfg: Config) -> int:
    return cfg.train.batch_ramp[-1].batch_size if cfg.train.batch_ramp else cfg.train.batch_size


def prepare_run_dir(cfg: Config) -> Path:
    """Create ``runs/<name>/`` and write the resolved config; never overwrite an existing run."""
    run_dir = cfg.run.path
    if run_dir.exists() and any(run_dir.iterdir()):
        raise FileExistsError(
            f"run directory {run_dir} already holds a run; choose another run.name (or run.dir) "
            "or move the old run away"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def _to_device(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in batch.items()}


class BatchProducer:
    """Produces (plan, host batch) step after step, following the batch ramp and curriculum.

    Runs on the prefetch thread, ahead of training; the plan depends only on tokens already
    produced, so it is the same whether or not batches are prefetched.
    """

    def __init__(self, cfg: Config, tokenizer: Any):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tokens_seen = 0
        self.rows, self.stage = None, -1

    def __call__(self) -> tuple[StepPlan, dict[str, np.ndarray]]:
        cfg = self.cfg
        plan = plan_for(cfg, self.tokens_seen)
        if plan.stage != self.stage:  # a new curriculum stage: new sequence length and mixture
            self.rows = make_row_iterator(
                cfg.data,
                self.tokenizer,
                seq_len=plan.seq_len,
                seed=cfg.train.seed + plan.stage,
                mixture=plan.mixture,
                process_index=jax.process_index(),
                process_count=jax.process_count(),
            )
            self.stage = plan.stage
        self.tokens_seen += plan.batch_size * plan.seq_len
        return plan, next_batch(self.rows, plan.batch_size)


def train(cfg: Config, *, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns a summary (final eval loss, time, throughput)."""
    start_time = time.perf_counter()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size}"
        )
    run_dir = prepare_run_dir(cfg)
    writer = MetricsWriter(run_dir, progress_total=cfg.train.steps if progress else None)

    variables = init_variables(cfg.model, cfg.train.seed)
    tx = build_optimizer(cfg.optim, model_param_groups(cfg.model, cfg.optim.router_group), cfg.train.steps)
    state = init_train_state(variables, tx)
    step_fn = jax.jit(make_train_step(cfg, tx, set_lr_scale), donate_argnums=0)
    eval_fn = jax.jit(make_eval_step(cfg))
    held_out = [
        _to_device(b)
        for b in eval_batches(
            cfg.data,
            tokenizer,
            seq_len=cfg.train.seq_len,
            batch_size=cfg.train.batch_size,
            num_batches=cfg.train.eval_batches,
            seed=cfg.train.seed,
        )
    ]

    def evaluate(state: TrainState) -> float:
        total, count = 0.0, 0.0
        for batch in held_out:
            ce, n = eval_fn(state.params, state.balancing, batch)
            total, count = total + float(ce), count + float(n)
        return total / max(count, 1.0)

    peak, peak_source = peak_flops(cfg.model.dtype)
    writer.event(
        {"event": "start", "peak_flops": peak, "peak_source": peak_source, "devices": jax.device_count()}
    )
    batches = Prefetcher(BatchProducer(cfg, tokenizer), cfg.data.prefetch)
    tokens_seen, interval_tokens, interval_flops, data_wait = 0, 0, 0.0, 0.0
    interval_start = time.perf_counter()
    eval_loss = math.nan
    last: dict[str, Any] = {}
    try:
        for step in range(1, cfg.train.steps + 1):
            wait_start = time.perf_counter()
            plan, host_batch = next(batches)
            data_wait += time.perf_counter() - wait_start
            batch = _to_device(host_batch)
            lr_scale = batch_lr_scale(plan.batch_size, final_batch_size(cfg), cfg.optim.lr_batch_scaling)
            state, metrics = step_fn(state, batch, jnp.asarray(lr_scale, jnp.float32))
            step_tokens = plan.batch_size * plan.seq_len
            tokens_seen += step_tokens
            interval_tokens += step_tokens
            interval_flops += step_tokens * flops_per_token(cfg.model, plan.seq_len)

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
    finally:
        batches.close()

    step_dir = checkpoint.save_model(
        run_dir, cfg, {"params": state.params, BALANCING: state.balancing}, step=cfg.train.steps
    )
    summary = {
        "run_dir": str(run_dir),
        "checkpoint": str(step_dir),
        "steps": cfg.train.steps,
        "tokens": tokens_seen,
        "final_loss": last.get("loss"),
        "eval_loss": eval_loss,
        "wall_time_s": time.perf_counter() - start_time,
    }
    writer.event({"event": "end", **summary})
    writer.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
