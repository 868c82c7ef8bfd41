"""build_optimizer: clipping comes first, the lr scale is a state value (no retrace), lr metrics."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zaya_jax.config import OptimConfig
from zaya_jax.optim import (
    LeafGroup,
    MuonState,
    build_optimizer,
    current_learning_rates,
    learning_rate_schedule,
    param_groups,
    set_lr_scale,
)

AXES = {"w": ("embed", "heads"), "experts": ("experts", "embed", "expert_mlp"), "scale": ("embed",)}
SHAPES = {"w": (8, 12), "experts": (2, 8, 6), "scale": (8,)}
CFG = OptimConfig(warmup_steps=2, decay_fraction=0.5, min_lr_ratio=0.0, grad_clip=1.0)
TOTAL_STEPS = 6


def _tree(seed: int, scale: float = 1.0) -> dict[str, jax.Array]:
    key = jax.random.key(seed)
    return {
        k: scale * jax.random.normal(jax.random.fold_in(key, i), s) for i, (k, s) in enumerate(SHAPES.items())
    }


def _find(state, kind: type) -> list:
    return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind)) if isinstance(x, kind)]


def test_huge_gradient_is_clipped_to_grad_clip_before_the_update():
    tx = build_optimizer(CFG, param_groups(AXES), TOTAL_STEPS)
    params = _tree(0)
    _, state = jax.jit(tx.update)(_tree(1, scale=1e6), tx.init(params), params)
    # After one step each first moment is (1 - beta) * the gradient the branches saw.
    (muon,) = _find(state, MuonState)
    (adam,) = _find(state, optax.ScaleByAdamState)
    seen = [m / (1 - CFG.muon_momentum) for m in jax.tree.leaves(muon.mu)]
    seen += [m / (1 - CFG.adam_b1) for m in jax.tree.leaves(adam.mu)]
    assert len(seen) == 3
    np.testing.assert_allclose(optax.tree.norm(seen), CFG.grad_clip, rtol=1e-5)


def test_grad_clip_zero_disables_clipping():
    tx = build_optimizer(dataclasses.replace(CFG, grad_clip=0.0), param_groups(AXES), TOTAL_STEPS)
    params = _tree(0)
    _, state = jax.jit(tx.update)(_tree(1, scale=1e6), tx.init(params), params)
    (adam,) = _find(state, optax.ScaleByAdamState)
    np.testing.assert_allclose(adam.mu["scale"] / (1 - CFG.adam_b1), _tree(1, scale=1e6)["scale"], rtol=1e-5)


def test_lr_scale_changes_the_update_proportionally_without_retracing():
    tx = build_optimizer(CFG, param_groups(AXES), TOTAL_STEPS)
    params, grads = _tree(0), _tree(1)
    traces = 0

    @jax.jit
    def step(state):
        nonlocal traces
        traces += 1
        return tx.update(grads, state, params)

    state = tx.init(params)
    _, state = step(state)  # step 0 is the start of warmup, where the lr is 0
    full, _ = step(state)
    for value in (0.5, 0.25):
        scaled, new_state = step(set_lr_scale(state, value))
        jax.tree.map(lambda s, f, v=value: np.testing.assert_array_equal(s, v * f), scaled, full)
        assert float(current_learning_rates(new_state)["lr_scale"]) == value
    assert traces == 1


def test_current_learning_rates_follow_the_schedules_and_scale():
    tx = build_optimizer(CFG, param_groups(AXES), TOTAL_STEPS, lr_scale=0.5)
    params = _tree(0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    muon = learning_rate_schedule(CFG.schedule, CFG.muon_lr, TOTAL_STEPS, 2, 0.5, 0.0)
    adam = learning_rate_schedule(CFG.schedule, CFG.adam_lr, TOTAL_STEPS, 2, 0.5, 0.0)
    for step in range(4):
        rates = current_learning_rates(state)
        np.testing.assert_allclose(rates["muon_lr"], 0.5 * muon(step), rtol=1e-6)
        np.testing.assert_allclose(rates["adam_lr"], 0.5 * adam(step), rtol=1e-6)
        _, state = update(_tree(step), state, params)


def test_muon_weight_decay_shrinks_matrices_by_lr_times_wd():
    cfg = dataclasses.replace(CFG, muon_weight_decay=0.5, adam_weight_decay=0.0, grad_clip=0.0)
    tx = build_optimizer(cfg, param_groups(AXES), TOTAL_STEPS)
    params = _tree(0)
    zero = jax.tree.map(jnp.zeros_like, params)
    state = tx.init(params)
    _, state = tx.update(zero, state, params)  # step 0: lr = 0
    updates, _ = tx.update(zero, state, params)
    lr = float(learning_rate_schedule(cfg.schedule, cfg.muon_lr, TOTAL_STEPS, 2, 0.5, 0.0)(1))
    np.testing.assert_allclose(updates["w"], -lr * 0.5 * params["w"], rtol=1e-6)
    np.testing.assert_array_equal(updates["scale"], 0.0)  # a vector under AdamW: no decay


def test_groups_tree_that_does_not_match_params_is_a_clear_error():
    tx = build_optimizer(CFG, {"w": LeafGroup("muon", (0, 1))}, TOTAL_STEPS)
    with pytest.raises(ValueError, match="groups tree does not match the parameters"):
        tx.init(_tree(0))
