"""Low-rank adapters as the model reads them: a ``lora`` subtree in a scope's parameters holds, for
each adapted weight ``W`` of that scope, its factors ``{"a": A, "b": B}`` at ``W``'s own path, and
one ``scale``; the model uses ``W + scale * A @ B`` wherever it would use ``W`` (:func:`fold`).

Two scopes hold adapters: the scanned blocks (``params["layers"]["lora"]``: every factor and the
scale carry the leading ``layers`` axis, so the scan hands each block its own slice and each
block folds only its own weights, transiently, inside the scan) and the top (``params["lora"]``:
the embedding table, also the tied LM head). Folding needs no configuration, so every forward pass
(training, evaluation, sampling, the reference pass) runs the adapted model when the parameters
carry adapters, and the base model when they do not. The model folds each weight where it reads it
(:func:`adapted`); :func:`fold` and :func:`merged` do the same to a tree of parameters.

A weight ``W`` of shape ``(*lead, in, out)`` (``lead``: the layer axis, and the expert axis of
``wi``/``wo``) has ``A`` of shape ``(*lead, in, r)`` and ``B`` of shape ``(*lead, r, out)``: each
expert of each layer has its own pair. The fold is summed in float32 (rounded into a bfloat16
base's dtype) and rematerialised (``jax.checkpoint``): the backward pass recomputes the adapted weight from ``W``, ``A`` and ``B``
rather than keeping a second copy of every adapted weight. Which weights a role adapts is
:data:`ROLE_PATHS`; the roles and the refused ones are :mod:`zaya_jax.config.lora`'s, and a
run's adapters are made and planned in :mod:`zaya_jax.lora`. Nothing here reads a config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

ADAPTER = "lora"  # the key of a scope's adapter subtree
FACTORS = ("a", "b")
SCANNED = "layers"  # the scope of the scanned blocks

# Role -> the weights it adapts ("/"-joined paths in the params tree).
ROLE_PATHS: dict[str, tuple[str, ...]] = {
    "experts": ("layers/experts/wi", "layers/experts/wo"),
    "attention": tuple(
        f"layers/attn/{name}/kernel" for name in ("q_proj", "k_proj", "v_current", "v_delayed", "o_proj")
    ),
    "embeddings": ("embedding",),
}

Params = Mapping[str, Any]


def location(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(scope, path within the scope's adapter subtree) of a weight path."""
    keys = tuple(path.split("/"))
    return (keys[:1], keys[1:]) if keys[0] == SCANNED else ((), keys)


def is_factor(node: Any) -> bool:
    return isinstance(node, Mapping) and set(node) == set(FACTORS)


def _adapted(weight: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    """``W + s A B``: in float32 for a float32 ``W``; for a narrower one (``lora.base_dtype``) the
    float32 product is rounded to ``W``'s dtype and added there, as a bfloat16 model computes with
    the weight anyway, rather than making a float32 copy of ``W``."""
    s = jnp.reshape(scale, jnp.shape(scale) + (1,) * (weight.ndim - jnp.ndim(scale)))
    product = s.astype(jnp.float32) * jnp.einsum(
        "...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32)
    )
    if weight.dtype == jnp.float32:
        return weight + product
    return weight + product.astype(weight.dtype)


_adapted_remat = jax.checkpoint(_adapted)


def fold(params: Params) -> Params:
    """One scope's parameters with its adapters folded in (``W + scale * A @ B``, float32) and the
    ``lora`` subtree removed; ``params`` itself when it has none. ``scale`` may carry leading axes
    of the weights (the whole stack of layers, :func:`merged`)."""
    if ADAPTER not in params:
        return params
    rest = {k: v for k, v in params.items() if k != ADAPTER}
    adapters = params[ADAPTER]
    scale = adapters["scale"]

    def walk(node: Mapping[str, Any], factors: Mapping[str, Any], where: str) -> dict[str, Any]:
        out = dict(node)
        for key, sub in factors.items():
            if key not in node:
                raise ValueError(f"adapters for {where}{key}, which the model does not have")
            if is_factor(sub):
                out[key] = _adapted_remat(node[key], sub["a"], sub["b"], scale)
            else:
                out[key] = walk(node[key], sub, f"{where}{key}/")
        return out

    return walk(rest, {k: v for k, v in adapters.items() if k != "scale"}, "")


def adapted(module: nn.Module, name: str, weight: jax.Array) -> jax.Array:
    """``weight`` (the parameter ``name`` of ``module``, as read) with the adapter the parameters
    carry for it folded in: the nearest enclosing scope holding a ``lora`` subtree (a block inside
    the layer scan, or the model's top) is looked up at the weight's path from there. Called by
    every parameter read (:func:`zaya_jax.model.layers.param_with_axes`), inside the block and so
    inside its rematerialisation, whatever ``model.remat`` is."""
    scope, inner = module.scope, [name]
    while scope is not None:
        if scope.has_variable("params", ADAPTER):
            adapters = scope.get_variable("params", ADAPTER)
            node: Any = adapters
            for key in reversed(inner):
                if not isinstance(node, Mapping) or key not in node:
                    return weight
                node = node[key]
            return (
                _adapted_remat(weight, node["a"], node["b"], adapters["scale"]) if is_factor(node) else weight
            )
        inner.append(scope.name)
        scope = scope.parent
    return weight


def merged(params: Params) -> dict[str, Any]:
    """The whole tree's adapters folded into their weights (float32): plain parameters, as a model
    without adapters has them (an export, a merged checkpoint)."""
    out = dict(fold(params))
    if SCANNED in out:
        out[SCANNED] = dict(fold(out[SCANNED]))
    return out


def switched_off(params: Params) -> dict[str, Any]:
    """``params`` with every adapter's ``B`` zero: the base's function exactly (``W + s A 0 = W``),
    in the same tree (and shardings) as ``params``, sharing the base's arrays."""
    train, frozen = split(params)
    return join(jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if getattr(path[-1], "key", None) == "b" else x, train
    ), frozen)  # fmt: skip


def has_adapters(params: Params) -> bool:
    return ADAPTER in params or (isinstance(params.get(SCANNED), Mapping) and ADAPTER in params[SCANNED])


def adapter_part(params: Params) -> dict[str, Any]:
    """Only the ``lora`` subtrees of ``params`` (factors and scales), at their paths."""
    out: dict[str, Any] = {}
    if ADAPTER in params:
        out[ADAPTER] = params[ADAPTER]
    layers = params.get(SCANNED)
    if isinstance(layers, Mapping) and ADAPTER in layers:
        out[SCANNED] = {ADAPTER: layers[ADAPTER]}
    return out


def base_part(params: Params) -> dict[str, Any]:
    """``params`` without its ``lora`` subtrees: the base model; ``join(adapter_part(p),
    base_part(p))`` is ``p`` again."""
    out = {k: v for k, v in params.items() if k != ADAPTER}
    layers = out.get(SCANNED)
    if isinstance(layers, Mapping) and ADAPTER in layers:
        out[SCANNED] = {k: v for k, v in layers.items() if k != ADAPTER}
    return out


def split(params: Params) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the factors, everything else): what trains and what is frozen, each a nested dict keeping
    the paths of ``params``; :func:`join` puts them back together."""

    def walk(node: Any, in_adapters: bool) -> tuple[Any, Any]:
        if not isinstance(node, Mapping):
            return (node, None) if in_adapters else (None, node)
        train, frozen = {}, {}
        for key, sub in node.items():
            inside = in_adapters or key == ADAPTER
            t, f = walk(sub, inside and key != "scale")
            if t is not None and not _empty(t):
                train[key] = t
            if f is not None and not _empty(f):
                frozen[key] = f
        return train, frozen

    train, frozen = walk(params, False)
    return train, frozen


def _empty(node: Any) -> bool:
    return isinstance(node, dict) and not node


def join(train: Params, frozen: Params) -> dict[str, Any]:
    """The inverse of :func:`split`."""
    out = dict(frozen)
    for key, sub in train.items():
        out[key] = join(sub, frozen.get(key, {})) if isinstance(sub, Mapping) else sub
    return out
