"""The ``mesh`` section: the device mesh and the logical-axis rule overrides (the divisibility
rules a whole config must meet on a mesh are :func:`zaya_jax.config.schema.check_layout`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from zaya_jax.config.errors import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "context")


@dataclasses.dataclass(frozen=True)
class AxisRule:
    """Logical axis ``name`` is split over the mesh axes ``mesh`` (empty: replicated)."""

    name: str  # logical axis (embed, experts, vocab, ...)
    mesh: tuple[str, ...] = ()  # mesh axes it is split over (empty: replicated)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh: sizes of the ``data``, ``fsdp``, ``expert`` and ``context`` axes, one of
    which may be -1 (all devices left over). The global batch is split over data x fsdp x expert,
    the sequence over context, expert weights over expert and the residual width of every weight
    (and its optimizer state) over fsdp; with ``optimizer_sharding: zero1`` the optimizer state is
    also split over data and context. ``rules`` override entries of the logical-axis table
    (``zaya_jax.parallel.rules.DEFAULT_RULES``)."""

    data: int = -1  # data-parallel replicas (-1: the devices left over)
    fsdp: int = 1  # parameter/optimizer sharding over the residual width
    expert: int = 1  # expert-parallel groups (divides num_experts)
    context: int = 1  # sequence split (ring attention, CCA halos)
    # How a sequence is split over the context axis: "zigzag" (2 x context chunks, device i holding
    # chunks i and 2 x context - 1 - i: every device does the same causal attention work; needs
    # sequence lengths divisible by 2 x context) or "contiguous" (device i holds the i-th part).
    context_layout: Literal["zigzag", "contiguous"] = "zigzag"
    # Expert parallelism: rows exchanged per device pair = factor x local tokens / |expert|;
    # 0 = all local tokens (dropless). Tokens beyond it are dropped and counted.
    expert_capacity_factor: float = 0.0
    # How tokens travel to their experts: "padded" all_to_all (every platform), "ragged"
    # (jax.lax.ragged_all_to_all, only routed rows; GPU/TPU) or "auto" (ragged unless on CPU).
    expert_exchange: Literal["auto", "padded", "ragged"] = "auto"
    # Where the optimizer state lives: "none" (like its parameter) or "zero1" (ZeRO-1, ZAYA1's
    # layout: also split over the data and context axes, whose devices hold the same parameters;
    # gradients reduce-scattered, the update computed on each device's share, the new parameters
    # all-gathered once per step).
    optimizer_sharding: Literal["none", "zero1"] = "none"
    rules: tuple[AxisRule, ...] = ()  # overrides of the logical-axis table (see below)

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def validate(self) -> None:
        sizes = self.sizes()
        auto = [axis for axis, size in sizes.items() if size == -1]
        if len(auto) > 1:
            raise ConfigError(f"mesh axes {auto} are all -1; at most one axis may be auto-filled")
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise ConfigError(f"mesh.{axis}={size} must be a positive size or -1 (auto)")
        if self.expert_capacity_factor < 0:
            raise ConfigError(
                f"mesh.expert_capacity_factor={self.expert_capacity_factor} must be >= 0 (0 = dropless)"
            )
        for rule in self.rules:
            unknown = [a for a in rule.mesh if a not in MESH_AXES]
            if unknown:
                raise ConfigError(
                    f"mesh.rules entry {rule.name!r} names unknown mesh axes {unknown}; use {MESH_AXES}"
                )
