"""A run's parallel layout: the mesh, the rules and the shardings of everything the step touches."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zaya_jax.config import Config, ModelConfig
from zaya_jax.lora.plan import EVERY_PARAMETER, ParameterPlan, parameter_plan
from zaya_jax.model.mesh_hooks import SINGLE_DEVICE, ModelHooks
from zaya_jax.ops import sharded_residual_rms_norm
from zaya_jax.ops.kernel_plan import KernelPlan, program_platform, resolve_kernel_plan
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
from zaya_jax.parallel.tree import tree_attention


@dataclasses.dataclass(frozen=True)
class Layout:
    """``variables``: shardings of ``{"params", "balancing"}``; ``batch``: of (batch, seq) inputs."""

    mesh: Mesh
    rules: tuple[tuple[str, Any], ...]
    variables: dict[str, Any]
    batch: NamedSharding
    replicated: NamedSharding
    # Expert parallelism when the expert axis is > 1, ring attention and conv halos when the
    # context axis is > 1, the fused-norm kernel per device when the kernel plan takes it, and the
    # kernel plan itself (hooks.kernels).
    hooks: ModelHooks = SINGLE_DEVICE
    # ZeRO-1 (mesh.optimizer_sharding: zero1): the shardings of the optimizer state, the gradients
    # and the update, per parameter; None: they follow the parameters.
    update: dict[str, Any] | None = None
    # With expert parallelism: the exchange mesh.expert_exchange resolved to (padded, ragged) and why
    expert_exchange: dict[str, str] | None = None
    # What trains and what is frozen (zaya_jax.lora.plan), built once from the config here.
    parameters: ParameterPlan = EVERY_PARAMETER

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

    @property
    def kernels(self) -> KernelPlan:
        """The kernel plan of this layout's programs (resolved in :func:`make_layout`)."""
        return self.hooks.kernels if self.hooks.kernels is not None else KernelPlan()


def make_layout(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Layout:
    """The layout of ``cfg``'s mesh over ``devices`` (default: all), with the kernel plan of its
    programs (:func:`~zaya_jax.ops.kernel_plan.resolve_kernel_plan`, from ``model.kernels``,
    ``model.attention_impl`` and ``optim.kernels`` on these devices)."""
    mesh = make_mesh(cfg, devices)
    rules = logical_rules(cfg.mesh)
    platform = program_platform(list(mesh.devices.flat))
    kernels = resolve_kernel_plan(
        cfg.model,
        cfg.optim.kernels,
        devices=mesh.size,
        platform=platform,
        ns_formulation=cfg.optim.ns_formulation,
    )
    dispatch, exchange = None, None
    if mesh.shape["expert"] > 1:
        resolved = resolve_exchange(mesh, cfg.mesh.expert_exchange)
        dispatch = expert_dispatch(
            mesh, cfg.mesh.expert_capacity_factor, resolved, rules, kernels.moe_gemm == "kernel"
        )
        exchange = {"configured": cfg.mesh.expert_exchange, "exchange": resolved}
        if probes_exchange(mesh, cfg.mesh.expert_exchange):
            exchange["why"] = probed_exchange(mesh)[1]  # cached: the probe ran once
    rows, seq = batch_spec(mesh, rules)
    parameters = parameter_plan(cfg)
    variables = variable_shardings(cfg.model, mesh, rules, parameters)
    update = None
    if cfg.mesh.optimizer_sharding == "zero1":
        abstract = nn.unbox(parameters.boxed(cfg.model))
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
            if kernels.norm == "kernel" and mesh.size > 1
            else None,
            kernels=kernels,
        ),
        update,
        exchange,
        parameters,
    )


def program_hooks(model: ModelConfig, mesh: Mesh | None = None) -> ModelHooks:
    """The hooks of a program that is not a run's (the rollout engine, the static sampler, a
    notebook's ``Zaya(cfg, program_hooks(cfg))``): tree attention over ``mesh``'s ``context`` axis
    where given, and the kernel plan for its devices (one, without a mesh)."""
    devices = list(mesh.devices.flat) if mesh is not None else None
    kernels = resolve_kernel_plan(model, devices=len(devices or [0]), platform=program_platform(devices))
    return ModelHooks(attention=tree_attention(mesh) if mesh is not None else None, kernels=kernels)
