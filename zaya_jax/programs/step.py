"""The pure training step ``(state, batch, lr_scale, loss_limit) -> (state, metrics)`` and the
state it updates. Jitted with its shardings in one place, :func:`zaya_jax.programs.build_programs`.

The step splits a batch into ``micro_batches`` accumulated by a ``lax.scan``; the objective (a
spec's binding of a loss, :mod:`zaya_jax.loss.contract`, handed in by the caller) is a sum over the
batch divided by its weight (trained tokens, pairs or completion tokens) over the whole batch, so
accumulation gives the same gradient as one big batch. Every metric the step returns is a scalar or
a vector and goes to ``metrics.jsonl`` under its own name
(:func:`zaya_jax.train.metrics.metric_record`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from zaya_jax.config import Config
from zaya_jax.lora.plan import B_GRAD_NORMS, EVERY_PARAMETER, ParameterPlan
from zaya_jax.loss import Batch, Objective, under_axis_rules
from zaya_jax.model import BALANCING, Zaya
from zaya_jax.model.balancing import ControllerState, init_controller, probability_spread, update_biases
from zaya_jax.model.mesh_hooks import SINGLE_DEVICE, ModelHooks
from zaya_jax.optim import current_learning_rates
from zaya_jax.resilience.routing import within_limits


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: dict[str, Any]
    opt_state: optax.OptState
    balancing: dict[str, Any]
    controller: ControllerState


def init_train_state(
    variables: dict[str, Any], tx: optax.GradientTransformation, parameters: ParameterPlan = EVERY_PARAMETER
) -> TrainState:
    """Step 0: fresh optimizer state for what trains (``parameters``: a frozen base has none); the
    controller starts from the variables' balancing biases."""
    biases = variables[BALANCING]["layers"]["router"]["biases"]
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=variables["params"],
        opt_state=tx.init(parameters.split(variables["params"])[0]),
        balancing=variables[BALANCING],
        controller=init_controller(biases),
    )


def make_train_step(
    cfg: Config,
    tx: optax.GradientTransformation,
    set_lr_scale: Callable[[optax.OptState, jax.Array], optax.OptState],
    hooks: ModelHooks = SINGLE_DEVICE,
    axis_rules: tuple[jax.sharding.Mesh, Sequence[tuple[str, Any]]] | None = None,
    update_shardings: dict[str, Any] | None = None,
    parameters: ParameterPlan = EVERY_PARAMETER,
    *,
    objective: Objective,
) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """Build the step that minimises ``objective`` (a spec's binding, :mod:`zaya_jax.objectives`);
    jit it with ``donate_argnums=0``. ``set_lr_scale(opt_state, s)`` injects the
    batch-ramp learning-rate multiplier as a traced value (no recompilation per value).
    ``hooks``: expert and context parallelism and the sharded fused-norm kernel on a mesh
    (``Layout.hooks``); ``axis_rules``: (mesh, logical-axis rules) for the
    activations' sharding constraints (``Layout.step_hooks``); ``update_shardings``: ZeRO-1's
    per-parameter shares (``Layout.update``), which the gradients and the update are constrained
    to (XLA then reduce-scatters the gradients and all-gathers the new parameters); ``parameters``:
    what trains (the gradient and the update are of that part only; the frozen rest passes through)."""
    model = Zaya(cfg.model, hooks)
    micro = cfg.train.micro_batches
    grad_fn = jax.grad(  # with respect to what trains only: no gradient of a frozen base is computed
        lambda trained, frozen, b, batch: objective.loss_and_stats(
            model, parameters.join(trained, frozen), b, batch
        ),
        has_aux=True,
    )

    def step(
        state: TrainState, batch: Batch, lr_scale: jax.Array, loss_limit: jax.Array | None = None
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """With ``loss_limit`` (a float32 scalar; ``inf`` for none) the step keeps the previous
        state on a bad step (:func:`_guarded`)."""
        trained, frozen = parameters.split(state.params)
        grads, stats = _accumulated_grads(grad_fn, (trained, frozen, state.balancing), batch, micro)
        weight = jnp.maximum(stats["weight"], 1.0)
        grads = jax.tree.map(lambda g: g / weight, grads)
        grad_norm = optax.tree.norm(grads)
        opt_state = set_lr_scale(state.opt_state, lr_scale)
        if update_shardings is not None:  # ZeRO-1: reduce-scatter the gradients, update each share
            shares = parameters.split(update_shardings)[0]
            grads = jax.lax.with_sharding_constraint(grads, shares)
            trained = jax.lax.with_sharding_constraint(trained, shares)

        balancing, controller = state.balancing, state.controller
        biases = state.balancing["layers"]["router"]["biases"]
        spread = probability_spread(stats["prob_dev_sum"], stats["prob_dev_sq_sum"], stats["routed"])
        if cfg.balancing.enabled:
            biases, controller, _ = update_biases(
                cfg.balancing, state.controller, biases, stats["load"], spread
            )
            balancing = {"layers": {"router": {"biases": biases}}}

        load = stats["load"] / jnp.maximum(stats["load"].sum(-1, keepdims=True), 1.0)  # (layers, E+1)
        metrics = _step_metrics(stats, load, weight, grad_norm, biases, spread)
        metrics["routing"] = _routing_health(cfg, stats, load, biases, state.controller.base)
        if parameters.guards_inert_adapters:  # the guard's input (zaya_jax.train.steps, first step)
            metrics[B_GRAD_NORMS] = parameters.b_grad_norms(grads)

        accept = None if loss_limit is None else _accepted(cfg, objective, metrics, grad_norm, loss_limit)
        trained, opt_state = _optimizer_update(tx, grads, opt_state, trained, state.opt_state, accept)
        if accept is not None:  # a rejected step keeps the balancing state too
            chosen = functools.partial(jnp.where, accept)
            balancing = jax.tree.map(chosen, balancing, state.balancing)
            controller = jax.tree.map(chosen, controller, state.controller)
        new_state = TrainState(state.step + 1, trained, opt_state, balancing, controller)
        new_state = new_state.replace(params=parameters.join(new_state.params, frozen))
        rates = current_learning_rates(new_state.opt_state)  # a metric: logging never reads the state
        metrics["lr"], metrics["muon_lr"] = rates["adam_lr"], rates["muon_lr"]
        return new_state, metrics

    return under_axis_rules(step, axis_rules)


def _optimizer_update(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: optax.OptState,
    trained: Any,
    old_opt_state: optax.OptState,
    accept: jax.Array | None,
) -> tuple[Any, optax.OptState]:
    """(trained, optimizer state) after the optimizer's update; with ``accept`` (a traced bool) the
    update runs under ``lax.cond`` only when it holds, else ``trained`` and ``old_opt_state`` come
    back as they were (selecting between the two states after the update would hold both: 2 GB a
    device of ZAYA1-8B's 4k plan)."""

    def update(operands: tuple[Any, ...]) -> tuple[Any, optax.OptState]:
        grads, opt_state, trained, _ = operands
        updates, opt_state = tx.update(grads, opt_state, trained)
        # all-gathered into the parameters' layout on exit (ZeRO-1's shares)
        return optax.apply_updates(trained, updates), opt_state

    def keep(operands: tuple[Any, ...]) -> tuple[Any, optax.OptState]:
        return operands[2], operands[3]

    operands = (grads, opt_state, trained, old_opt_state)
    return update(operands) if accept is None else jax.lax.cond(accept, update, keep, operands)


def _accepted(
    cfg: Config,
    objective: Objective,
    metrics: dict[str, jax.Array],
    grad_norm: jax.Array,
    loss_limit: jax.Array,
) -> jax.Array:
    """Whether the step is applied (else the previous trained parameters, optimizer and balancing
    state are kept, the step counted): not when the loss or gradient norm is not finite or the loss
    exceeds ``loss_limit`` (metrics ``skipped``, ``nonfinite``), when a metric passes its
    objective's bound (``bound_rejected``), and with ``resilience.on_routing_alarm: skip`` when its
    routing is past a limit (``routing_rejected``)."""
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    accept = finite & (metrics["loss"] <= loss_limit)
    if objective.bounds:  # NaN is past any bound
        within = jnp.all(jnp.stack([metrics[b.metric] <= b.limit for b in objective.bounds]))
        accept = accept & within
        metrics["bound_rejected"] = 1.0 - within.astype(jnp.float32)
    if cfg.resilience.on_routing_alarm == "skip":  # this step's routing past a limit: undone
        healthy = within_limits(cfg, metrics["routing"])
        accept = accept & healthy
        metrics["routing_rejected"] = 1.0 - healthy.astype(jnp.float32)
    metrics["skipped"] = 1.0 - accept.astype(jnp.float32)
    metrics["nonfinite"] = 1.0 - finite.astype(jnp.float32)
    return accept


def _accumulated_grads(
    grad_fn: Callable, arguments: tuple[Any, ...], batch: Batch, micro: int
) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """Summed gradients and loss statistics of ``grad_fn(*arguments, micro_batch)`` over ``micro``
    equal micro-batches of ``batch``."""
    if micro == 1:  # no loop: a one-step scan still costs a while loop and a zeroed carry
        return grad_fn(*arguments, batch)
    parts = jax.tree.map(lambda x: x.reshape(micro, x.shape[0] // micro, *x.shape[1:]), batch)
    first = jax.tree.map(lambda x: x[0], parts)
    shapes = jax.eval_shape(grad_fn, *arguments, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    for name, start in EXTREMES.items():  # a loss's extremes start from the identity of their reduction
        if name in zeros[1]:
            zeros[1][name] = jax.tree.map(
                lambda s, start=start: jnp.full(s.shape, start, s.dtype), shapes[1][name]
            )

    def accumulate(carry, micro_batch):
        grads, stats = grad_fn(*arguments, micro_batch)
        summed = jax.tree.map(
            jnp.add, (carry[0], _without_extremes(carry[1])), (grads, _without_extremes(stats))
        )
        extremes = {
            name: jax.tree.map(reduce, carry[1][name], stats[name])
            for name, reduce in (("maxima", jnp.maximum), ("minima", jnp.minimum))
            if name in stats
        }
        return (summed[0], {**summed[1], **extremes}), None

    return jax.lax.scan(accumulate, zeros, parts)[0]


EXTREMES = {"maxima": -jnp.inf, "minima": jnp.inf}  # stats reduced by max / min over micro-batches


def _without_extremes(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if k not in EXTREMES}


def _routing_health(
    cfg: Config, stats: dict[str, jax.Array], load: jax.Array, biases: jax.Array, base: jax.Array
) -> dict[str, jax.Array]:
    """Per-layer routing statistics for the routing-health monitor (:mod:`zaya_jax.resilience.routing`;
    not written to ``metrics.jsonl``): each class's share of the tokens, the router's mean entropy
    over ln(E + 1), and which balancing biases sit at their clamp (``balancing.max_bias``)."""
    classes = load.shape[-1]
    routed = jnp.maximum(stats["routed"], 1.0)
    pinned = jnp.abs(jnp.abs(biases - base) - cfg.balancing.max_bias) < 1e-6
    return {
        "load": load,
        "entropy": stats["entropy_sum"] / routed / jnp.log(float(classes)),
        "pinned": pinned.astype(jnp.float32),
    }


def _step_metrics(
    stats: dict[str, jax.Array],
    load_fraction: jax.Array,
    weight: jax.Array,
    grad_norm: jax.Array,
    biases: jax.Array,
    spread: jax.Array,
) -> dict[str, jax.Array]:
    """The step's scalars and vectors, each under its name in ``metrics.jsonl``: the objective's
    sums per unit of its weight (``loss`` first; for ``lm`` also ``log_z_squared``, the z-loss term
    before its weight ``train.z_loss``), then the optimizer's and the router's (``load_fraction``:
    each class's share of each layer's tokens)."""
    experts = load_fraction[:, :-1]
    return {
        **{name: total / weight for name, total in stats["sums"].items()},
        **stats.get("maxima", {}),  # an objective's extremes over the batch (grpo: max_ratio)
        **stats.get("minima", {}),
        "grad_norm": grad_norm,
        "expert_load": load_fraction.mean(0),  # (E+1,) averaged over layers
        # inf (null in metrics.jsonl) while some expert receives no token at all
        "max_min_load_ratio": jnp.where(
            jnp.min(experts) > 0, jnp.max(experts) / jnp.maximum(jnp.min(experts), 1e-30), jnp.inf
        ),
        "skip_fraction": load_fraction[:, -1].mean(),
        "dropped_tokens": stats["dropped"].sum(),
        "bias_mean": biases[:, :-1].mean(),
        "bias_std": biases[:, :-1].std(),
        "bias_skip": biases[:, -1].mean(),
        "router_prob_spread": spread.mean(),
        # with captured routes (grpo): the fraction of (token, layer) whose router, unforced,
        # would choose another class than the sampler did (what router replay prevents)
        **({"route_flips": stats["route_flips"] / jnp.maximum(stats["routes_captured"], 1.0)}
           if "route_flips" in stats else {}),
    }  # fmt: skip
