"""How the model runs: on more than one device, four optional, typed replacements of local code
paths, and the program's kernel plan (:mod:`zaya_jax.ops.kernel_plan`), bundled as
:class:`ModelHooks`. Parameters and results are the same with or without them (the plan's kernels to
float rounding); ``zaya_jax.parallel.Layout.hooks`` builds them for a mesh, the rollout engine and
``zaya_jax.generate`` for decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax

from zaya_jax.config import ModelConfig
from zaya_jax.ops.attention import AttentionMask
from zaya_jax.ops.kernel_plan import KernelPlan, reference_plan


class MoeDispatch(Protocol):
    """Expert parallelism (``zaya_jax.parallel.expert``): ``m`` (batch, seq, H) global, ``choice`` and
    ``weight`` (batch, seq), expert weights ``wi``/``wo`` -> (output like ``m``, dropped tokens)."""

    def __call__(
        self, m: jax.Array, choice: jax.Array, weight: jax.Array, wi: jax.Array, wo: jax.Array, act: str
    ) -> tuple[jax.Array, jax.Array]: ...


class AttentionKernel(Protocol):
    """A replacement attention kernel, e.g. tree attention over a sequence-split decode cache
    (``zaya_jax.parallel.tree``): (q, k, v, mask) -> (batch, seq, nq*d)."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask) -> jax.Array: ...


class ContextParallelism(Protocol):
    """CCA's temporal parts and attention over a sequence split across devices
    (``zaya_jax.parallel.ring.ContextParallel``)."""

    def temporal(
        self,
        z: jax.Array,
        vd: jax.Array,
        vd_at_start: jax.Array,
        segments: jax.Array,
        dw_kernel: jax.Array,
        dw_bias: jax.Array,
        g_kernel: jax.Array,
        g_bias: jax.Array,
        context: int,
    ) -> tuple[jax.Array, jax.Array]:
        """(two-stage convolution of ``z``, delayed values shifted by one token)."""
        ...

    def attention(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        segments: jax.Array,
        token_mask: jax.Array,
        window: jax.Array | None,
    ) -> jax.Array: ...

    def reorder(self, x: jax.Array) -> jax.Array:
        """(batch, seq, ...) in sequence order -> the order the devices hold it in (a zig-zag
        layout balances the causal work); identity for contiguous shards."""
        ...

    def restore(self, x: jax.Array) -> jax.Array:
        """The inverse of :meth:`reorder`."""
        ...


class ResidualNorm(Protocol):
    """The fused residual merge + RMSNorm (``zaya_jax.ops.residual_norm``), e.g. inside a
    ``shard_map`` on a mesh: (f, h, five parameter vectors) -> (h', RMSNorm(h'))."""

    def __call__(
        self,
        f: jax.Array,
        h: jax.Array,
        hidden_bias: jax.Array,
        hidden_scale: jax.Array,
        residual_bias: jax.Array,
        residual_scale: jax.Array,
        norm_weight: jax.Array,
        *,
        eps: float,
    ) -> tuple[jax.Array, jax.Array]: ...


@dataclasses.dataclass(frozen=True)
class ModelHooks:
    """Every field ``None``: the single-device code paths, in pure JAX (``kernels``: the program's
    kernel plan, :func:`~zaya_jax.ops.kernel_plan.resolve_kernel_plan`)."""

    moe_dispatch: MoeDispatch | None = None
    attention: AttentionKernel | None = None
    context: ContextParallelism | None = None
    residual_norm: ResidualNorm | None = None
    kernels: KernelPlan | None = None

    def plan(self, cfg: ModelConfig) -> KernelPlan:
        """The kernel plan the model runs: the one handed down, else the pure-JAX reference."""
        return self.kernels if self.kernels is not None else reference_plan(cfg)


SINGLE_DEVICE = ModelHooks()
