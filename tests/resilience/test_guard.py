"""The loss guard: the jitted step keeps its previous state when the loss or gradients are not
finite or the loss exceeds the limit; the robust z-score limit; error classes for events."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.fixtures import synthetic_batch, tiny_train_config
from zaya_jax.config import ResilienceConfig
from zaya_jax.model import init_variables
from zaya_jax.objectives.lm import next_token
from zaya_jax.optim import build_optimizer, model_param_groups, set_lr_scale
from zaya_jax.programs import init_train_state, make_train_step
from zaya_jax.resilience import LossGuard, classify_runtime_error


def test_guarded_step_keeps_the_previous_state_on_a_bad_step():
    cfg = tiny_train_config(batch_size=2)
    tx = build_optimizer(cfg.optim, model_param_groups(cfg.model, cfg.optim.router_group), cfg.train.steps)
    step = jax.jit(make_train_step(cfg, tx, set_lr_scale, objective=next_token(cfg)))
    state = init_train_state(init_variables(cfg.model, 0), tx)
    batch = synthetic_batch(0, 2, 16)
    one = jnp.asarray(1.0)
    state, _ = step(state, batch, one, jnp.float32(np.inf))  # past lr warm-up's 0
    # a NaN fault is injected on the host, as tests/resilience/faults.py's FaultHook does: the loss mask poisoned
    poisoned = {**batch, "loss_mask": batch["loss_mask"] * np.float32(np.nan)}
    cases = {"ok": (batch, np.inf), "spike": (batch, 0.0), "nan": (poisoned, np.inf)}
    outcomes = {}
    for name, (inputs, limit) in cases.items():
        new, metrics = step(state, inputs, one, jnp.float32(limit))
        changed = any(
            not np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params), strict=True)
        )
        opt_same = all(
            np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(state.opt_state), strict=True)
        )
        outcomes[name] = (
            changed,
            opt_same,
            float(metrics["skipped"]),
            float(metrics["nonfinite"]),
            int(new.step),
        )
    assert outcomes["ok"] == (True, False, 0.0, 0.0, 2)
    assert outcomes["spike"] == (False, True, 1.0, 0.0, 2)  # the step counter still advances
    assert outcomes["nan"] == (False, True, 1.0, 1.0, 2)


def test_loss_guard_limit_is_a_robust_zscore_bound():
    guard = LossGuard(ResilienceConfig(on_spike="skip", spike_zscore=6.0, spike_window=50, spike_warmup=10))
    rng = np.random.default_rng(0)
    losses = 3.0 + 0.01 * rng.standard_normal(40)
    for i, loss in enumerate(losses):
        if i < 10:
            assert guard.limit() == np.inf  # warming up
        guard.accept(float(loss))
    limit = guard.limit()
    assert 3.03 < limit < 3.2  # ~6 robust standard deviations above the median
    assert limit < 3.5  # a jump of 0.5 nats is flagged
    guard.accept(100.0)  # one outlier in the window barely moves a median-based bound
    assert abs(guard.limit() - limit) < 0.01
    lagged = LossGuard(
        ResilienceConfig(on_spike="skip", spike_zscore=6.0, spike_window=50, spike_warmup=10), lag=1
    )
    for step, loss in enumerate(losses[:20], start=1):
        lagged.accept(float(loss), step)
    lagged.accept(100.0, 21)
    # step 22's limit leaves out step 21's loss, read or not; step 23's takes it in
    unread = LossGuard(lagged.cfg, lag=1)
    for step, loss in enumerate(losses[:20], start=1):
        unread.accept(float(loss), step)
    assert lagged.limit(22) == unread.limit(22) < 3.5
    assert lagged.limit(23) != lagged.limit(22)
    off = LossGuard(ResilienceConfig(on_spike="none"))
    for loss in losses:
        off.accept(float(loss))
    assert off.limit() == np.inf


def test_runtime_errors_are_classified():
    cases = {
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate": "out_of_memory",
        "DEADLINE_EXCEEDED: barrier timed out": "collective_timeout",
        "NCCL error: unhandled system error": "communication",
        "uncorrectable ECC error encountered": "hardware",
        "INTERNAL: something else": "runtime",
    }
    for message, expected in cases.items():
        assert classify_runtime_error(RuntimeError(message)) == expected
