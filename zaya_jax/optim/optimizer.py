"""Muon + AdamW as one optax chain, with a learning-rate multiplier that lives in the optimizer state.

    clip_by_global_norm(grad_clip)                      (skipped when grad_clip = 0)
    partition by LeafGroup label:
      muon : scale_by_muon -> + muon_weight_decay * p -> * -schedule(muon_lr)(step)
      adamw: scale_by_adam -> + adam_weight_decay * p (matrices/tables only) -> * -schedule(adam_lr)(step)
    * lr_scale                                          (LrScaleState, set at run time)

Weight decay is decoupled and multiplied by the scheduled lr (and the lr scale), as in
``optax.adamw``, PyTorch and Moonlight: ``p <- p - lr * (update + wd * p)``.

The lr scale (for batch-size ramps) is an array in the optimizer state, not a Python constant, so
changing it never recompiles the step::

    opt_state = set_lr_scale(opt_state, batch_lr_scale(batch, final_batch, cfg.optim.lr_batch_scaling))
    params, opt_state = train_step(params, opt_state, batch)   # same compiled step for every value

Differences from ``optax.contrib.muon``: the AdamW branch is plain AdamW (optax's uses Nesterov
Adam when ``nesterov=True``), and AdamW's weight decay skips vectors (norms, biases, scales).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zaya_jax.config import OptimConfig
from zaya_jax.optim.groups import group_labels, is_leaf_group
from zaya_jax.optim.muon import NS_EPS, scale_by_muon
from zaya_jax.optim.schedules import learning_rate_schedule

_GROUPS = ("muon", "adamw")


class ScheduledLrState(NamedTuple):
    """count: () int32 updates so far; learning_rate: () float32 lr the next update uses."""

    count: jax.Array
    learning_rate: jax.Array


class LrScaleState(NamedTuple):
    """lr_scale: () float32 multiplier of every update (both groups)."""

    lr_scale: jax.Array


def scale_by_scheduled_lr(schedule: optax.Schedule) -> optax.GradientTransformation:
    """``updates * -schedule(count)``, like ``optax.scale_by_learning_rate``, but keeping the lr of the
    next step in the state so ``current_learning_rates`` can report it without the schedule."""

    def init_fn(params: optax.Params) -> ScheduledLrState:
        del params
        count = jnp.zeros([], jnp.int32)
        return ScheduledLrState(count, jnp.asarray(schedule(count), jnp.float32))

    def update_fn(
        updates: optax.Updates, state: ScheduledLrState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScheduledLrState]:
        del params
        step_size = -1 * schedule(state.count)
        updates = jax.tree.map(lambda u: jnp.array(step_size, dtype=u.dtype) * u, updates)
        count = optax.safe_increment(state.count)
        return updates, ScheduledLrState(count, jnp.asarray(schedule(count), jnp.float32))

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_lr_scale(initial: float | jax.Array = 1.0) -> optax.GradientTransformation:
    """Multiply updates by ``LrScaleState.lr_scale``, a value the trainer sets with ``set_lr_scale``."""

    def init_fn(params: optax.Params) -> LrScaleState:
        del params
        return LrScaleState(jnp.asarray(initial, jnp.float32))

    def update_fn(
        updates: optax.Updates, state: LrScaleState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, LrScaleState]:
        del params
        updates = jax.tree.map(lambda u: state.lr_scale.astype(u.dtype) * u, updates)
        return updates, state

    return optax.GradientTransformation(init_fn, update_fn)


def _decay_mask(groups_tree: dict[str, Any]) -> Callable[[optax.Params], Any]:
    """Callable weight-decay mask for the AdamW branch; it sees masked trees (MaskedNode on Muon leaves)."""

    def mask(tree: optax.Params) -> Any:
        return jax.tree.map(
            lambda g, x: x if isinstance(x, optax.MaskedNode) else g.decay,
            groups_tree,
            tree,
            is_leaf=is_leaf_group,
        )

    return mask


def build_optimizer(
    optim_cfg: OptimConfig,
    groups_tree: dict[str, Any],
    total_steps: int,
    lr_scale: float | jax.Array = 1.0,
    shardings: dict[str, Any] | None = None,
    newton_schulz: str = "jax",
) -> optax.GradientTransformationExtraArgs:
    """The training optimizer: clipping, Muon for ``"muon"`` leaves, AdamW for the rest, lr scale.

    ``groups_tree``: :class:`~zaya_jax.optim.groups.LeafGroup` per parameter, the structure of the
    params (``param_groups`` / ``model_param_groups``). ``total_steps``: the schedule's length.
    ``lr_scale``: the initial lr multiplier (change it later with :func:`set_lr_scale`).
    ``shardings``: the parameters' NamedShardings on a mesh; Muon then runs Newton-Schulz on
    gathered matrices per device, with no collective inside the iteration. ``newton_schulz``: what
    runs Muon's iteration, the kernel plan's choice (``Programs`` passes its layout's,
    :mod:`zaya_jax.ops.kernel_plan`); ``jax``, XLA's loop, without one.
    """
    optim_cfg.validate()
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")

    def schedule(peak: float) -> optax.Schedule:
        return learning_rate_schedule(
            optim_cfg.schedule,
            peak,
            total_steps,
            optim_cfg.warmup_steps,
            optim_cfg.decay_fraction,
            optim_cfg.min_lr_ratio,
        )

    muon = optax.chain(
        scale_by_muon(
            groups_tree,
            beta=optim_cfg.muon_momentum,
            nesterov=optim_cfg.nesterov,
            ns_coeffs=optim_cfg.ns_coeffs,
            ns_steps=optim_cfg.ns_steps,
            eps=NS_EPS,
            consistent_rms=optim_cfg.consistent_rms,
            shardings=shardings,
            newton_schulz=newton_schulz,
            ns_formulation=optim_cfg.ns_formulation,
        ),
        optax.add_decayed_weights(optim_cfg.muon_weight_decay),
        scale_by_scheduled_lr(schedule(optim_cfg.muon_lr)),
    )
    adamw = optax.chain(
        optax.scale_by_adam(b1=optim_cfg.adam_b1, b2=optim_cfg.adam_b2, eps=optim_cfg.adam_eps),
        optax.add_decayed_weights(optim_cfg.adam_weight_decay, mask=_decay_mask(groups_tree)),
        scale_by_scheduled_lr(schedule(optim_cfg.adam_lr)),
    )
    chain = optax.chain(
        *([optax.clip_by_global_norm(optim_cfg.grad_clip)] if optim_cfg.grad_clip > 0 else []),
        optax.partition({"muon": muon, "adamw": adamw}, group_labels(groups_tree)),
        scale_by_lr_scale(lr_scale),
    )

    def init_fn(params: optax.Params) -> optax.OptState:
        expected = jax.tree.structure(groups_tree, is_leaf=is_leaf_group)
        got = jax.tree.structure(params)
        if expected != got:
            raise ValueError(
                "the optimizer groups tree does not match the parameters; build it from the same model "
                f"config (model_param_groups(cfg.model)).\n  groups: {expected}\n  params: {got}"
            )
        return chain.init(params)

    return optax.GradientTransformationExtraArgs(init_fn, chain.update)


def _is_state(x: Any) -> bool:
    return isinstance(x, ScheduledLrState | LrScaleState)


def set_lr_scale(opt_state: optax.OptState, value: float | jax.Array) -> optax.OptState:
    """``opt_state`` with the lr multiplier set to ``value`` (works inside or outside ``jit``).

    The multiplier is a float32 scalar in the state, so a new value reuses the compiled step.
    """
    found = False

    def replace(x: Any) -> Any:
        nonlocal found
        if isinstance(x, LrScaleState):
            found = True
            return LrScaleState(jnp.asarray(value, jnp.float32))
        return x

    new_state = jax.tree.map(replace, opt_state, is_leaf=_is_state)
    if not found:
        raise ValueError("opt_state holds no LrScaleState; it was not made by build_optimizer")
    return new_state


def current_learning_rates(opt_state: optax.OptState) -> dict[str, jax.Array]:
    """Learning rates the next update applies: ``{"muon_lr", "adam_lr", "lr_scale"}`` (float32 scalars).

    ``muon_lr``/``adam_lr`` include the lr scale; ``lr_scale`` is the multiplier itself.
    """
    rates: dict[str, jax.Array] = {}
    scale = None
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_state)[0]:
        if isinstance(leaf, LrScaleState):
            scale = leaf.lr_scale
        elif isinstance(leaf, ScheduledLrState):
            group = next((k.key for k in path if getattr(k, "key", None) in _GROUPS), None)
            if group is not None:
                rates[group] = leaf.learning_rate
    if scale is None or set(rates) != set(_GROUPS):
        raise ValueError("opt_state was not made by build_optimizer (no lr scale or group schedules found)")
    return {"muon_lr": rates["muon"] * scale, "adam_lr": rates["adamw"] * scale, "lr_scale": scale}
