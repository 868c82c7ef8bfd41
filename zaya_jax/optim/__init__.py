"""Muon + AdamW in one optax chain: parameter groups from logical axis names, Muon, lr schedules.

Typical use (the trainer)::

    groups = model_param_groups(cfg.model, cfg.optim.router_group)
    tx = build_optimizer(cfg.optim, groups, total_steps=cfg.train.steps)
    opt_state = tx.init(params)
    # batch-size ramp: a new multiplier is a new value in the state, not a recompile
    opt_state = set_lr_scale(opt_state, batch_lr_scale(batch, final_batch, cfg.optim.lr_batch_scaling))
    metrics |= current_learning_rates(opt_state)
"""

from zaya_jax.optim.groups import (
    LeafGroup,
    describe_groups,
    group_labels,
    leaf_group,
    model_param_groups,
    param_groups,
    param_logical_axes,
)
from zaya_jax.optim.muon import (
    DEFAULT_NS_COEFFS,
    MuonState,
    newton_schulz,
    orthogonalize,
    scale_by_muon,
    shape_scale,
)
from zaya_jax.optim.optimizer import (
    LrScaleState,
    ScheduledLrState,
    build_optimizer,
    current_learning_rates,
    scale_by_lr_scale,
    scale_by_scheduled_lr,
    set_lr_scale,
)
from zaya_jax.optim.schedules import batch_lr_scale, learning_rate_schedule

__all__ = [
    "DEFAULT_NS_COEFFS",
    "LeafGroup",
    "LrScaleState",
    "MuonState",
    "ScheduledLrState",
    "batch_lr_scale",
    "build_optimizer",
    "current_learning_rates",
    "describe_groups",
    "group_labels",
    "leaf_group",
    "learning_rate_schedule",
    "model_param_groups",
    "newton_schulz",
    "orthogonalize",
    "param_groups",
    "param_logical_axes",
    "scale_by_lr_scale",
    "scale_by_muon",
    "scale_by_scheduled_lr",
    "set_lr_scale",
    "shape_scale",
]
