"""Low-rank adapters on a ZAYA parameter tree: which weights a role names, one pair of factors per
weight (per expert and layer on the stacked expert leaves), and the merged weights.

A weight ``W`` of shape ``(*lead, in, out)`` (``lead``: the scanned layer axis, and the expert axis
of ``wi``/``wo``; the model computes ``x @ W``) gets ``A`` of shape ``(*lead, in, r)`` and ``B`` of
shape ``(*lead, r, out)``, so the adapted weight is ``W + s * A @ B`` with ``s = alpha / r`` (or
``alpha / sqrt(r)``, rsLoRA). Each expert of each layer has its own pair: no factor is shared
across experts (qwix shares B across an expert-batched einsum; Megatron-Bridge moved to one adapter
per expert, NVIDIA-NeMo/Megatron-Bridge#5484). ``B`` starts at zero, so the adapted model starts
equal to the base, bit for bit (:func:`merge` returns the base's own arrays there), and at that
point only ``B`` can receive a gradient (``dL/dA = s * dL/dW @ B^T = 0``): :func:`inert` names
the adapters whose ``B`` got none.

Targets are roles, not module names: ``experts`` (every routed expert's fused gate/up ``wi`` and
its ``wo``), ``attention`` (CCA's q, k, value and output projections) and ``embeddings`` (off by
default). The router, its EDA state and the balancing biases are refused: the router picks each
token's expert by an argmax and the biases are set by the balancing controller, not by gradients
(an "all-linear" adapter on the router changes routing, AgileRL#630).

Why not an existing library: qwix intercepts ``dot_general``/``einsum`` but not the grouped matmul
of the sorted MoE path, Levanter and torchtitan adapt linear modules only (stacked experts get
none). Adapting the weights themselves works for every MoE path (sorted, capacity, dense, expert
parallel) as they are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

# Role -> the weights it adapts ("/"-joined paths in the params tree).
ROLES: dict[str, tuple[str, ...]] = {
    "experts": ("layers/experts/wi", "layers/experts/wo"),
    "attention": tuple(
        f"layers/attn/{name}/kernel" for name in ("q_proj", "k_proj", "v_current", "v_delayed", "o_proj")
    ),
    "embeddings": ("embedding",),
}
REFUSED: dict[str, str] = {
    "router": "the router picks each token's expert by an argmax of its output, so an adapter there "
    "changes routing rather than the experts; adapt the experts",
    "eda": "the router's exponential depth averaging state is part of the router (see 'router')",
    "balancing": "the balancing biases are set by the balancing controller, not by gradients",
}
DEFAULT_TARGETS = ("experts", "attention")

Params = Mapping[str, Any]
Adapters = dict[str, dict[str, jax.Array]]  # path -> {"a": A, "b": B}


@dataclasses.dataclass(frozen=True)
class Lora:
    """Rank, scale and targets of a model's adapters."""

    rank: int
    alpha: float = 16.0
    rslora: bool = False  # s = alpha / sqrt(rank) instead of alpha / rank
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank!r} must be an integer >= 1")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} must be a finite number > 0")
        for role in self.targets:
            if role in REFUSED:
                raise ValueError(f"LoRA target {role!r} is refused: {REFUSED[role]}")
            if role not in ROLES:
                raise ValueError(f"unknown LoRA target {role!r}; the targets are {', '.join(ROLES)}")
        if not self.targets:
            raise ValueError(f"LoRA needs at least one target of {', '.join(ROLES)}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def _get(params: Params, path: str) -> Any:
    node: Any = params
    for key in path.split("/"):
        node = node[key]
    return node


def targeted(params: Params, lora: Lora) -> list[str]:
    """The weights of ``params`` that ``lora``'s targets adapt; a target naming no weight of this
    model is an error."""
    paths = []
    for role in lora.targets:
        for path in ROLES[role]:
            try:
                weight = _get(params, path)
            except (KeyError, TypeError):
                raise ValueError(f"LoRA target {role!r}: the model has no {path}") from None
            if weight.ndim < 2:
                raise ValueError(f"LoRA target {role!r}: {path} has shape {weight.shape}, not a matrix")
            paths.append(path)
    return paths


def init_adapters(params: Params, lora: Lora, key: jax.Array) -> Adapters:
    """Float32 factors of every targeted weight: ``A`` uniform in +-1/sqrt(in) (PEFT's Kaiming
    default), ``B`` zero."""
    adapters = {}
    paths = targeted(params, lora)
    for path, k in zip(paths, jax.random.split(key, len(paths)), strict=True):
        weight = _get(params, path)
        *lead, fan_in, fan_out = weight.shape
        bound = 1.0 / math.sqrt(fan_in)
        adapters[path] = {
            "a": jax.random.uniform(k, (*lead, fan_in, lora.rank), jnp.float32, -bound, bound),
            "b": jnp.zeros((*lead, lora.rank, fan_out), jnp.float32),
        }
    return adapters


def delta(factors: Mapping[str, jax.Array], scale: float) -> jax.Array:
    """``s * A @ B`` of one weight (float32), with the weight's shape."""
    return scale * jnp.einsum("...ir,...ro->...io", factors["a"], factors["b"])


def merge(params: Params, adapters: Adapters, lora: Lora) -> dict[str, Any]:
    """``params`` with every adapted weight replaced by ``W + s * A @ B`` (summed in float32, stored
    in ``W``'s dtype); other leaves are the base's own arrays. Differentiable in ``adapters``."""

    def rebuild(node: Any, prefix: str) -> Any:
        if isinstance(node, Mapping):
            return {k: rebuild(v, f"{prefix}/{k}" if prefix else k) for k, v in node.items()}
        if prefix not in adapters:
            return node
        factors = adapters[prefix]
        if factors["a"].shape[:-1] != node.shape[:-1] or factors["b"].shape[-1] != node.shape[-1]:
            raise ValueError(
                f"LoRA factors {factors['a'].shape} x {factors['b'].shape} do not fit {prefix} {node.shape}"
            )
        return (node.astype(jnp.float32) + delta(factors, lora.scale)).astype(node.dtype)

    unknown = set(adapters) - set(targeted(params, lora))
    if unknown:
        raise ValueError(f"adapters for weights the targets do not name: {', '.join(sorted(unknown))}")
    return rebuild(params, "")


def inert(grads: Adapters) -> list[str]:
    """The adapters whose ``B`` received an all-zero gradient (at the first step, when ``B`` is
    zero, ``A``'s gradient is zero by construction): an adapter that would never train. Example: a
    base whose CCA temperature is 0 (a fresh initialisation) attends uniformly, so q and k get no
    gradient, and with the base frozen their adapters never would (tests/lora/test_adapters.py)."""
    return sorted(path for path, g in grads.items() if not bool(jnp.any(g["b"] != 0)))
