"""The ``mesh`` section (the device mesh, the logical-axis rule overrides) and the parallel layout's
divisibility rules that a config must meet on a mesh (:func:`check_layout`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from zaya_jax.config.errors import ConfigError

if TYPE_CHECKING:
    from zaya_jax.config.schema import Config


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
    also split over data. ``rules`` override entries of the logical-axis table
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
    # layout: also split over the data axis; gradients reduce-scattered, the update computed on each
    # device's share, the new parameters all-gathered once per step).
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


def check_layout(cfg: Config, sizes: Mapping[str, int]) -> None:
    """The parallel layout's divisibility rules for ``cfg`` on mesh axis ``sizes`` (-1 entries are
    skipped: they are checked again once the device count fills them)."""
    known = {axis: size for axis, size in sizes.items() if size > 0}
    if cfg.model.num_experts % known.get("expert", 1):
        raise ConfigError(
            f"model.num_experts={cfg.model.num_experts} is not divisible by mesh.expert={known['expert']}; "
            "choose an expert axis size that divides the number of experts"
        )
    shards = [axis for axis in ("data", "fsdp", "expert") if axis in known]
    split = math.prod(known[axis] for axis in shards)
    batch_sizes = {cfg.train.batch_size, *(p.batch_size for p in cfg.train.batch_ramp)}
    for size in sorted(batch_sizes):
        per_micro = size // cfg.train.micro_batches
        if per_micro % split:
            raise ConfigError(
                f"a micro-batch of {per_micro} sequences (batch {size} / train.micro_batches="
                f"{cfg.train.micro_batches}) is not divisible by {' x '.join(f'mesh.{a}' for a in shards)}"
                f" = {split}; make every batch size a multiple of {split * cfg.train.micro_batches}"
            )
    context = known.get("context", 1)
    chunks = 2 * context if context > 1 and cfg.mesh.context_layout == "zigzag" else context
    seq_lens = {cfg.train.seq_len, *(s.seq_len for s in cfg.train.stages)}
    for seq_len in sorted(seq_lens):
        if seq_len % chunks:
            layout = f" in {chunks} zig-zag chunks (mesh.context_layout=zigzag)" if chunks != context else ""
            raise ConfigError(
                f"sequence length {seq_len} is not divisible by mesh.context={context}{layout}; "
                f"use sequence lengths that are multiples of {chunks}"
                + (" or set mesh.context_layout=contiguous" if layout else "")
            )
