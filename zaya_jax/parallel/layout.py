"""A run's parallel layout: the mesh, the rules and the shardings of everything the step touches."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zaya_jax.config import Config
from zaya_jax.model.adapters import boxed_with_adapters
from zaya_jax.model.mesh_hooks import SINGLE_DEVICE, ModelHooks
from zaya_jax.model.transformer import boxed_abstract_variables
from zaya_jax.ops import sharded_residual_rms_norm
from zaya_jax.parallel.expert import expert_dispatch, probed_exchange, probes_exchange, resolve_exchange
from zaya_jax.parallel.mesh import batch_sharding, make_mesh, replicated
from zaya_jax.parallel.ring import ContextParallel
from zaya_jax.parallel.rules import (
    batch_spec,
    logical_rules,
    matching_shardings,
    variable_shardings,
    zero1_shardings,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """``variables``: shardings of ``{"params", "balancing"}``; ``batch``: of (batch, seq) inputs."""

    mesh: Mesh
    rules: tuple[tuple[str, Any], ...]
    variables: dict[str, Any]
    batch: NamedSharding
    replicated: NamedSharding
    # Expert parallelism when the expert axis is > 1, ring attention and conv halos when the
    # context axis is > 1, the fused-norm kernel per device when model.kernels == "custom".
    hooks: ModelHooks = SINGLE_DEVICE
    # ZeRO-1 (mesh.optimizer_sharding: zero1): the shardings of the optimizer state, the gradients
    # and the update, per parameter; None: they follow the parameters.
    update: dict[str, Any] | None = None
    # With expert parallelism: the exchange mesh.expert_exchange resolved to (padded, ragged) and why
    expert_exchange: dict[str, str] | None = None

    @property
    def step_hooks(self) -> dict[str, Any]:
        """Keyword arguments for ``make_train_step`` / ``make_eval_step``: the model's hooks and the
        mesh and rules under which the step is traced, so that logical sharding constraints on
        activations (the residual stream, the loss's vocabulary split) take effect."""
        return {"hooks": self.hooks, "axis_rules": (self.mesh, self.rules)}

    def state_shardings(self, abstract_state: Any) -> Any:
        """Shardings for a TrainState shaped like ``abstract_state`` (``jax.eval_shape`` output):
        parameters and balancing biases by the rules, optimizer state like its parameters (or
        its ZeRO-1 share), step and controller replicated."""
        params = self.variables["params"]
        updates = self.update if self.update is not None else params
        return abstract_state.replace(
            step=self.replicated,
            params=params,
            opt_state=matching_shardings(abstract_state.opt_state, abstract_state.params, updates, self.mesh),
            balancing=self.variables["balancing"],
            controller=jax.tree.map(lambda _: self.replicated, abstract_state.controller),
        )

    def describe(self) -> dict[str, int]:
        return dict(self.mesh.shape)


def make_layout(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Layout:
    mesh = make_mesh(cfg, devices)
    rules = logical_rules(cfg.mesh)
    dispatch, exchange = None, None
    if mesh.shape["expert"] > 1:
        resolved = resolve_exchange(mesh, cfg.mesh.expert_exchange)
        dispatch = expert_dispatch(mesh, cfg.mesh.expert_capacity_factor, resolved, rules)
        exchange = {"configured": cfg.mesh.expert_exchange, "exchange": resolved}
        if probes_exchange(mesh, cfg.mesh.expert_exchange):
            exchange["why"] = probed_exchange(mesh)[1]  # cached: the probe ran once
    rows, seq = batch_spec(mesh, rules)
    variables = variable_shardings(cfg.model, mesh, rules, cfg.lora)
    update = None
    if cfg.mesh.optimizer_sharding == "zero1":
        abstract = nn.unbox(boxed_with_adapters(boxed_abstract_variables(cfg.model), cfg.lora))
        update = zero1_shardings(abstract["params"], variables["params"], mesh)
    return Layout(
        mesh,
        rules,
        variables,
        batch_sharding(mesh, rules),
        replicated(mesh),
        ModelHooks(
            moe_dispatch=dispatch,
            context=ContextParallel(
                mesh, rows, block=cfg.model.attention_block, layout=cfg.mesh.context_layout
            )
            if mesh.shape["context"] > 1
            else None,
            residual_norm=sharded_residual_rms_norm(mesh, PartitionSpec(rows, seq, None))
            if cfg.model.kernels == "custom" and mesh.size > 1
            else None,
        ),
        update,
        exchange,
    )
