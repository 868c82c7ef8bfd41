"""The pure training step ``(state, batch, lr_scale) -> (state, metrics)`` and the loss.

A batch is a dict of (batch, seq) arrays: ``inputs``, ``targets``, ``segment_ids`` (0 = padding),
``positions`` and ``loss_mask``. The step splits it into ``micro_batches`` accumulated by a
``lax.scan``; the loss is the token-weighted mean next-token cross-entropy over the whole batch
(plus the optional z-loss), so accumulation gives the same gradient as one big batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from zaya_jax.config import Config
from zaya_jax.model import BALANCING, Zaya
from zaya_jax.model.balancing import ControllerState, init_controller, probability_spread, update_biases
from zaya_jax.model.transformer import lm_head_weights
from zaya_jax.ops.cross_entropy import chunked_cross_entropy

Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    balancing: Any
    controller: ControllerState


def init_train_state(variables: dict[str, Any], tx: optax.GradientTransformation) -> TrainState:
    """Step 0: fresh optimizer state; the controller starts from the variables' balancing biases."""
    biases = variables[BALANCING]["layers"]["router"]["biases"]
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=variables["params"],
        opt_state=tx.init(variables["params"]),
        balancing=variables[BALANCING],
        controller=init_controller(biases),
    )


def init_sharded_train_state(
    cfg: Config, tx: optax.GradientTransformation, layout: Any
) -> tuple[TrainState, TrainState]:
    """(state, state shardings): step 0 created directly in the ``layout``'s shardings, so no device
    ever holds the whole model. Values equal ``init_train_state(init_variables(cfg.model, seed), tx)``."""

    def init(key: jax.Array) -> TrainState:
        variables = nn.unbox(Zaya(cfg.model).init(key, jnp.zeros((1, 1), jnp.int32)))
        return init_train_state(variables, tx)

    key = jax.random.key(cfg.train.seed)
    shardings = layout.state_shardings(jax.eval_shape(init, key))
    return jax.jit(init, out_shardings=shardings)(key), shardings


def token_losses(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy and log-partition, both (batch, seq) float32; logits upcast first."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit, log_z


def _shard_vocab(x: jax.Array, axis: int) -> jax.Array:
    """The LM head inside the loss split along its vocabulary (logical axis ``vocab_parallel``),
    not along the residual width as the parameter is stored; a no-op outside the step's rules."""
    names = [None] * x.ndim
    names[axis] = "vocab_parallel"
    return nn.with_logical_constraint(x, tuple(names))


def loss_and_stats(
    model: Zaya, params: Any, balancing: Any, batch: Batch, z_loss: float, loss_chunk: int = 0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed (not averaged) loss over the batch's real targets, and the statistics to accumulate.

    The LM head is applied by :func:`~zaya_jax.ops.cross_entropy.chunked_cross_entropy`,
    ``loss_chunk`` sequence positions at a time (0: automatic), so the full float32 logits never
    exist; the result equals :func:`token_losses` of the model's logits."""
    hidden, aux = model.apply(
        {"params": params, BALANCING: balancing},
        batch["inputs"],
        token_mask=batch["segment_ids"] > 0,
        segment_ids=batch["segment_ids"],
        positions=batch["positions"],
        return_hidden=True,
    )
    weight, bias, vocab_axis = lm_head_weights(model.cfg, params)
    mask = batch["loss_mask"].astype(jnp.float32)
    ce, log_z = chunked_cross_entropy(
        hidden,
        weight,
        batch["targets"],
        bias=bias,
        vocab_axis=vocab_axis,
        chunk=loss_chunk,
        shard_vocab=_shard_vocab,
    )
    ce_sum = jnp.sum(ce * mask)
    z_sum = jnp.sum(jnp.square(log_z) * mask)
    stats = {
        "ce_sum": ce_sum,
        "z_sum": z_sum,
        "tokens": mask.sum(),
        "routed": (batch["segment_ids"] > 0).sum().astype(jnp.float32),
        "load": aux["load"],
        "dropped": aux["dropped"],
        "prob_dev_sum": aux["prob_dev_sum"],
        "prob_dev_sq_sum": aux["prob_dev_sq_sum"],
    }
    return ce_sum + z_loss * z_sum, stats


def _under_axis_rules(fn: Callable, axis_rules: tuple[Any, Any] | None) -> Callable:
    """``fn`` traced under a mesh and its logical-axis rules (``Layout.step_hooks``), so that the
    model's and the loss's logical sharding constraints apply; without them they are no-ops."""
    if axis_rules is None:
        return fn
    mesh, rules = axis_rules

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with nn.logical_axis_rules(rules), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def make_train_step(
    cfg: Config,
    tx: optax.GradientTransformation,
    set_lr_scale: Callable[[Any, jax.Array], Any],
    moe_dispatch: Any = None,
    context: Any = None,
    residual_norm: Any = None,
    axis_rules: tuple[Any, Any] | None = None,
) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """Build the step; jit it with ``donate_argnums=0``. ``set_lr_scale(opt_state, s)`` injects the
    batch-ramp learning-rate multiplier as a traced value (no recompilation per value).
    ``moe_dispatch``, ``context``, ``residual_norm``: expert and context parallelism and the
    sharded fused-norm kernel on a mesh; ``axis_rules``: (mesh, logical-axis rules) for the
    activations' sharding constraints (``Layout.step_hooks``)."""
    model = Zaya(cfg.model, moe_dispatch, context=context, residual_norm=residual_norm)
    micro = cfg.train.micro_batches
    grad_fn = jax.grad(
        lambda p, b, batch: loss_and_stats(model, p, b, batch, cfg.train.z_loss, cfg.train.loss_chunk),
        has_aux=True,
    )

    def step(
        state: TrainState, batch: Batch, lr_scale: jax.Array, guard: jax.Array | None = None
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """``guard`` (optional, float32 (2,)): [loss limit, gradient multiplier]. With it the step
        keeps the previous parameters, optimizer and balancing state when the loss or gradient
        norm is not finite or the loss exceeds the limit (metrics ``skipped``, ``nonfinite``);
        the multiplier is 1 except when a test injects NaN."""
        split = jax.tree.map(lambda x: x.reshape(micro, x.shape[0] // micro, *x.shape[1:]), batch)

        def accumulate(carry, micro_batch):
            grads, stats = grad_fn(state.params, state.balancing, micro_batch)
            return jax.tree.map(jnp.add, carry, (grads, stats)), None

        layers, classes = cfg.model.num_layers, cfg.model.num_experts + 1
        zero_stats = {
            "ce_sum": jnp.zeros(()),
            "z_sum": jnp.zeros(()),
            "tokens": jnp.zeros(()),
            "routed": jnp.zeros(()),
            "load": jnp.zeros((layers, classes)),
            "dropped": jnp.zeros((layers,)),
            "prob_dev_sum": jnp.zeros((layers, classes)),
            "prob_dev_sq_sum": jnp.zeros((layers, classes)),
        }
        if micro == 1:  # no loop: a one-step scan still costs a while loop and a zeroed carry
            grads, stats = grad_fn(state.params, state.balancing, batch)
        else:
            zero_grads = jax.tree.map(jnp.zeros_like, state.params)
            (grads, stats), _ = jax.lax.scan(accumulate, (zero_grads, zero_stats), split)

        tokens = jnp.maximum(stats["tokens"], 1.0)
        grads = jax.tree.map(lambda g: g / tokens, grads)
        if guard is not None:
            grads = jax.tree.map(lambda g: g * guard[1].astype(g.dtype), grads)
        grad_norm = optax.tree.norm(grads)
        opt_state = set_lr_scale(state.opt_state, lr_scale)
        updates, opt_state = tx.update(grads, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)

        balancing, controller = state.balancing, state.controller
        biases = state.balancing["layers"]["router"]["biases"]
        spread = probability_spread(stats["prob_dev_sum"], stats["prob_dev_sq_sum"], stats["routed"])
        if cfg.balancing.enabled:
            biases, controller, _ = update_biases(
                cfg.balancing, state.controller, biases, stats["load"], spread
            )
            balancing = {"layers": {"router": {"biases": biases}}}

        load_fraction = stats["load"] / jnp.maximum(stats["load"].sum(-1, keepdims=True), 1.0)
        metrics = {
            "loss": stats["ce_sum"] / tokens,
            "z_loss": stats["z_sum"] / tokens,
            "grad_norm": grad_norm,
            "tokens": stats["tokens"],
            "expert_load": load_fraction.mean(0),  # (E+1,) averaged over layers
            "max_min_load_ratio": jnp.max(load_fraction[:, :-1])
            / jnp.maximum(jnp.min(load_fraction[:, :-1]), 1e-9),
            "skip_fraction": load_fraction[:, -1].mean(),
            "dropped_tokens": stats["dropped"].sum(),
            "bias_mean": biases[:, :-1].mean(),
            "bias_std": biases[:, :-1].std(),
            "bias_skip": biases[:, -1].mean(),
            "router_prob_spread": spread.mean(),
        }
        new_state = TrainState(state.step + 1, params, opt_state, balancing, controller)
        if guard is not None:
            finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
            accept = finite & (metrics["loss"] <= guard[0])
            kept = jax.tree.map(lambda new, old: jnp.where(accept, new, old), new_state, state)
            new_state = kept.replace(step=state.step + 1)
            metrics["skipped"] = 1.0 - accept.astype(jnp.float32)
            metrics["nonfinite"] = 1.0 - finite.astype(jnp.float32)
        return new_state, metrics

    return _under_axis_rules(step, axis_rules)


def make_eval_step(
    cfg: Config,
    moe_dispatch: Any = None,
    context: Any = None,
    residual_norm: Any = None,
    axis_rules: tuple[Any, Any] | None = None,
) -> Callable[[Any, Any, Batch], tuple[jax.Array, jax.Array]]:
    """(params, balancing, batch) -> (summed cross-entropy, number of target tokens); arguments
    as :func:`make_train_step`'s."""
    model = Zaya(cfg.model, moe_dispatch, context=context, residual_norm=residual_norm)

    def evaluate(params: Any, balancing: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        _, stats = loss_and_stats(model, params, balancing, batch, 0.0, cfg.train.loss_chunk)
        return stats["ce_sum"], stats["tokens"]

    return _under_axis_rules(evaluate, axis_rules)
