"""The compiled programs of a training run: the train step (one executable per batch shape, as the
batch ramp and curriculum change it) and the held-out evaluation.

Each is compiled ahead of its first call, then every process waits at a barrier: on CPU (gloo) a
process still compiling would otherwise trip its peers' collective timeout.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zaya_jax.config import Config
from zaya_jax.data import eval_batches
from zaya_jax.loss import make_eval_step
from zaya_jax.optim import set_lr_scale
from zaya_jax.parallel import Layout, put_batch
from zaya_jax.parallel.distributed import barrier
from zaya_jax.resilience import Watchdog
from zaya_jax.train.schedule import local_rows
from zaya_jax.train.step import TrainState, make_train_step


class TrainStep:
    """``(state, batch, lr_scale, loss_limit) -> (state, metrics)``, compiled once per batch shape."""

    def __init__(
        self,
        cfg: Config,
        tx: optax.GradientTransformation,
        layout: Layout,
        shardings: TrainState,
        watchdog: Watchdog,
    ):
        self.cfg, self.watchdog = cfg, watchdog
        self._jitted = jax.jit(
            make_train_step(cfg, tx, set_lr_scale, **layout.step_hooks),
            in_shardings=(shardings, layout.batch, layout.replicated, layout.replicated),
            out_shardings=(shardings, layout.replicated),
            donate_argnums=0,
        )
        self._compiled: dict[tuple[int, ...], Any] = {}

    def __call__(
        self, step: int, state: TrainState, batch: dict[str, jax.Array], lr_scale: float, loss_limit: float
    ):
        args = (state, batch, jnp.asarray(lr_scale, jnp.float32), jnp.asarray(loss_limit, jnp.float32))
        shape = batch["inputs"].shape
        if shape not in self._compiled:
            self.watchdog.beat(step - 1, "compile")
            if jax.process_index() == 0:
                print(
                    f"zaya train: compiling the train step for batches of {shape[0]} x {shape[1]} tokens...",
                    file=sys.stderr,
                    flush=True,
                )
            self._compiled[shape] = self._jitted.lower(*args).compile()
            barrier(f"step {shape}", self.cfg.runtime.barrier_timeout_s)
        return self._compiled[shape](*args)


class HeldOut:
    """The run's held-out evaluation: ``train.eval_batches`` batches of the held-out split, placed
    on the mesh once; calling it returns the mean cross-entropy per target token."""

    def __init__(
        self, cfg: Config, tokenizer: Any, layout: Layout, shardings: TrainState, watchdog: Watchdog
    ):
        self.cfg, self.watchdog = cfg, watchdog
        self._jitted = jax.jit(
            make_eval_step(cfg, **layout.step_hooks),
            in_shardings=(shardings.params, shardings.balancing, layout.batch),
            out_shardings=layout.replicated,
        )
        self._compiled: Any = None
        self.batches = [
            put_batch(local_rows(b), layout.batch)
            for b in eval_batches(
                cfg.data,
                tokenizer,
                seq_len=cfg.train.seq_len,
                batch_size=cfg.train.batch_size,
                num_batches=cfg.train.eval_batches,
                seed=cfg.train.seed,
            )
        ]

    def __call__(self, step: int, state: TrainState) -> float:
        self.watchdog.beat(step, "eval" if self._compiled else "compile")
        if self._compiled is None:
            self._compiled = self._jitted.lower(state.params, state.balancing, self.batches[0]).compile()
            barrier("eval", self.cfg.runtime.barrier_timeout_s)
        total, count = 0.0, 0.0
        for batch in self.batches:
            ce, n = self._compiled(state.params, state.balancing, batch)
            total, count = total + float(ce), count + float(n)
        return total / max(count, 1.0)
