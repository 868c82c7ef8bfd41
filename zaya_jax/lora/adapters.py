"""Low-rank adapters on a ZAYA parameter tree (the ``lora`` config section,
:class:`~zaya_jax.config.LoraConfig`): a run's variables with adapters added and its base frozen,
the adapters as a flat ``path -> {"a", "b"}`` mapping (the PEFT export, the guards), and merged
weights.

The model reads adapters from its parameters (:mod:`zaya_jax.model.lowrank`: ``params["layers"]
["lora"]`` for the scanned blocks, ``params["lora"]`` for the embedding), so a tree with adapters
is the adapted model everywhere it is applied. Each expert of each layer has its own pair: no
factor is shared across experts (qwix shares B across an expert-batched einsum; Megatron-Bridge
moved to one adapter per expert, NVIDIA-NeMo/Megatron-Bridge#5484). ``B`` starts at zero, so the
adapted model starts equal to the base bit for bit, and at that point only ``B`` can receive a
gradient (``dL/dA = s * dL/dW @ B^T = 0``): :func:`inert` names the adapters whose ``B`` got none.

Why not an existing library: qwix intercepts ``dot_general``/``einsum`` but not the grouped matmul
of the sorted MoE path, Levanter and torchtitan adapt linear modules only (stacked experts get
none). Adapting the weights themselves, per block inside the scan, works for every MoE path
(sorted, capacity, dense, expert parallel) as it is; its cost is the adapted weight's gradient
``x^T dy`` per block (the weight-gradient matmuls a full fine-tuning step also runs), where a
factored ``(x A) B`` path in every MoE kernel would skip it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import LoraConfig, ModelConfig
from zaya_jax.model.lowrank import (
    ADAPTER,
    FACTORS,
    ROLE_PATHS,
    SCANNED,
    adapter_part,
    has_adapters,
    join,
    location,
    merged,
    split,
)
from zaya_jax.model.transformer import boxed_abstract_variables

Params = Mapping[str, Any]
Adapters = dict[str, dict[str, jax.Array]]  # path -> {"a": A, "b": B}


def _get(params: Params, path: str) -> Any:
    node: Any = params
    for key in path.split("/"):
        node = node[key]
    return node


def adapted_paths(lora: LoraConfig) -> list[str]:
    """The weights ``lora``'s targets adapt, in target order."""
    return [path for role in lora.targets for path in ROLE_PATHS[role]]


def _set(tree: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def with_adapters(
    params: Params, lora: LoraConfig, leaf: Callable[[str, Any, str], Any], scale: Callable[[Any, float], Any]
) -> dict[str, Any]:
    """``params`` with a ``lora`` subtree in each scope that ``lora`` adapts: ``leaf(path, weight,
    "a" or "b")`` makes each factor, ``scale(layers or None, s)`` the scope's scale (``layers``: the
    stack's length for the scanned scope)."""
    out = {k: (dict(v) if k == SCANNED else v) for k, v in params.items()}
    for path in adapted_paths(lora):
        scope, inner = location(path)
        try:
            weight = _get(params, path)
        except (KeyError, TypeError):
            raise ValueError(f"lora.targets: the model has no {path}") from None
        home = out[scope[0]] if scope else out
        adapters = home.setdefault(ADAPTER, {})
        for which in FACTORS:
            _set(adapters, (*inner, which), leaf(path, weight, which))
        if "scale" not in adapters:
            layers = _shape(weight)[0] if scope else None
            adapters["scale"] = scale(layers, lora.scale)
    return out


def _shape(leaf: Any) -> tuple[int, ...]:
    value = getattr(leaf, "value", leaf)  # a LogicallyPartitioned box or an array
    return tuple(value.shape)


def factor_shape(weight_shape: tuple[int, ...], which: str, rank: int) -> tuple[int, ...]:
    *lead, fan_in, fan_out = weight_shape
    return (*lead, fan_in, rank) if which == "a" else (*lead, rank, fan_out)


def factor_axes(weight_axes: tuple[str | None, ...], which: str) -> tuple[str | None, ...]:
    """Logical axes of a factor: ``A`` is split like the weight's input, ``B`` like its output, and
    both like its stack axes (layers, experts); the rank axis is never split."""
    *lead, fan_in, fan_out = weight_axes
    return (*lead, fan_in, None) if which == "a" else (*lead, None, fan_out)


def boxed_with_adapters(boxed: Mapping[str, Any], lora: LoraConfig) -> Mapping[str, Any]:
    """Boxed abstract variables (``nn.LogicallyPartitioned`` leaves, as
    :func:`~zaya_jax.model.transformer.boxed_abstract_variables` gives them) with ``lora``'s
    adapters added, each factor named by :func:`factor_axes` so that it is sharded with its weight
    (an expert's pair with its expert); ``boxed`` itself without adapters."""
    if not lora.enabled:
        return boxed

    def leaf(path: str, weight: nn.LogicallyPartitioned, which: str) -> nn.LogicallyPartitioned:
        shape = factor_shape(tuple(weight.value.shape), which, lora.rank)
        return nn.LogicallyPartitioned(
            jax.ShapeDtypeStruct(shape, jnp.float32), factor_axes(weight.names, which)
        )

    def scale(layers: int | None, _: float) -> Any:
        if layers is None:
            return jax.ShapeDtypeStruct((), jnp.float32)
        return nn.LogicallyPartitioned(jax.ShapeDtypeStruct((layers,), jnp.float32), ("layers",))

    return {**boxed, "params": with_adapters(boxed["params"], lora, leaf, scale)}


def targeted(params: Params, lora: LoraConfig) -> list[str]:
    """The weights of ``params`` that ``lora``'s targets adapt; a target naming no weight of this
    model is an error."""
    lora.validate()
    paths = adapted_paths(lora)
    for path in paths:
        try:
            weight = _get(params, path)
        except (KeyError, TypeError):
            raise ValueError(f"lora.targets: the model has no {path}") from None
        if weight.ndim < 2:
            raise ValueError(f"lora.targets: {path} has shape {weight.shape}, not a matrix")
    return paths


def init_adapters(params: Params, lora: LoraConfig, key: jax.Array) -> Adapters:
    """Float32 factors of every targeted weight: ``A`` uniform in +-1/sqrt(in) (PEFT's Kaiming
    default), ``B`` zero."""
    adapters = {}
    paths = targeted(params, lora)
    for path, k in zip(paths, jax.random.split(key, len(paths)), strict=True):
        shape = _get(params, path).shape
        bound = 1.0 / math.sqrt(shape[-2])
        adapters[path] = {
            "a": jax.random.uniform(k, factor_shape(shape, "a", lora.rank), jnp.float32, -bound, bound),
            "b": jnp.zeros(factor_shape(shape, "b", lora.rank), jnp.float32),
        }
    return adapters


def attach(params: Params, adapters: Mapping[str, Mapping[str, Any]], lora: LoraConfig) -> dict[str, Any]:
    """``params`` carrying ``adapters`` (the model then runs ``W + s A B``); factors that do not fit
    their weight, or adapt a weight the targets do not name, are refused."""
    paths = targeted(params, lora)
    unknown = set(adapters) - set(paths)
    if unknown:
        raise ValueError(f"adapters for weights the targets do not name: {', '.join(sorted(unknown))}")
    missing = set(paths) - set(adapters)
    if missing:
        raise ValueError(f"no adapters given for {', '.join(sorted(missing))}")
    for path in paths:
        shape, factors = _get(params, path).shape, adapters[path]
        for which in FACTORS:
            if tuple(factors[which].shape) != factor_shape(shape, which, lora.rank):
                raise ValueError(
                    f"LoRA factors {factors['a'].shape} x {factors['b'].shape} do not fit {path} {shape} "
                    f"at rank {lora.rank}"
                )
    return with_adapters(
        params,
        lora,
        lambda path, _, which: jnp.asarray(adapters[path][which], jnp.float32),
        lambda layers, s: jnp.full(() if layers is None else (layers,), s, jnp.float32),
    )


def adapters_of(params: Params) -> Adapters:
    """The adapters ``params`` carries, by the path of the weight each adapts."""
    found: Adapters = {}

    def walk(node: Mapping[str, Any], prefix: tuple[str, ...]) -> None:
        for key, sub in node.items():
            if key == "scale":
                continue
            if set(sub) == set(FACTORS):
                found["/".join((*prefix, key))] = dict(sub)
            else:
                walk(sub, (*prefix, key))

    if ADAPTER in params:
        walk(params[ADAPTER], ())
    layers = params.get("layers")
    if isinstance(layers, Mapping) and ADAPTER in layers:
        walk(layers[ADAPTER], ("layers",))
    return found


def merge(params: Params, adapters: Adapters, lora: LoraConfig) -> dict[str, Any]:
    """``params`` with every adapted weight replaced by ``W + s * A @ B`` (summed in float32, stored
    in ``W``'s dtype); other leaves are the base's own arrays. Differentiable in ``adapters``."""
    out = merged(attach(params, adapters, lora))
    for path in adapters:
        keys = path.split("/")
        node = out
        for key in keys[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        node[keys[-1]] = node[keys[-1]].astype(_get(params, path).dtype)
    return out


def base_cast(params: Params, dtype: str) -> dict[str, Any]:
    """The frozen base as ``lora.base_dtype`` stores it: matrices (two or more axes) in ``dtype``,
    vectors kept."""
    return jax.tree.map(lambda x: x.astype(dtype) if x.ndim >= 2 else x, dict(params))


def adapted_variables(variables: Params, lora: LoraConfig, key: jax.Array) -> dict[str, Any]:
    """A LoRA run's variables: the base's params (matrices in ``lora.base_dtype``) carrying fresh
    adapters (``B`` zero: the model computes exactly what the base computes, up to the storage
    dtype)."""
    params = variables["params"]
    adapters = init_adapters(params, lora, key)
    return {**variables, "params": attach(base_cast(params, lora.base_dtype), adapters, lora)}


def _host(x: Any) -> np.ndarray:
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def _layout(adapters: Params) -> list[tuple[str, tuple[int, ...], float | None]]:
    """Each adapter leaf's path and shape, and the scales' values: what decides whether adapters
    can continue as another run's."""
    return [
        (
            jax.tree_util.keystr(path),
            tuple(np.shape(x)),
            float(_host(x).reshape(-1)[0]) if "scale" in str(path) else None,
        )
        for path, x in jax.tree_util.tree_leaves_with_path(adapters)
    ]


def arranged(source: Params, target_adapters: Params) -> dict[str, Any]:
    """``source``'s parameters as a start for a model whose adapters are ``target_adapters``
    (:func:`~zaya_jax.model.lowrank.adapter_part` of its parameters; empty without adapters): its
    base and adapters when they have the target's rank, targets and scale (a PEFT directory or a
    LoRA run continued); otherwise ``source`` merged (its adapters, if any, folded in) as the base,
    under ``target_adapters``. The one rule for ``train.init_from`` and for loading a LoRA step."""
    if has_adapters(source) and target_adapters and _layout(adapter_part(source)) == _layout(target_adapters):
        return dict(source)
    base = merged(source) if has_adapters(source) else dict(source)
    return join(target_adapters, base) if target_adapters else base


def adapter_count(model: ModelConfig, lora: LoraConfig) -> int:
    """How many numbers ``lora``'s factors hold on ``model`` (what a LoRA run trains)."""
    boxed = boxed_with_adapters(boxed_abstract_variables(model), lora)
    factors = split(nn.unbox(boxed)["params"])[0] if lora.enabled else {}
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(factors))


def adapter_names(lora: LoraConfig) -> list[str]:
    """The adapted weights in the order :func:`b_grad_norms` reports them."""
    return sorted(adapted_paths(lora))


def b_grad_norms(grads: Params) -> jax.Array:
    """The norm of each adapter's ``B`` gradient (``grads`` shaped like the trainable part of the
    parameters, :func:`zaya_jax.model.lowrank.split`), in :func:`adapter_names` order."""
    flat = adapters_of(grads)
    return jnp.stack([jnp.sqrt(jnp.sum(jnp.square(flat[p]["b"]))) for p in sorted(flat)])


def inert(grads: Params) -> list[str]:
    """The adapters whose ``B`` received an all-zero gradient (at the first step, when ``B`` is
    zero, ``A``'s gradient is zero by construction): an adapter that would never train. Example: a
    base whose CCA temperature is 0 (a fresh initialisation) attends uniformly, so q and k get no
    gradient, and with the base frozen their adapters never would (tests/lora/test_adapters.py).
    ``grads``: a flat ``path -> {"a", "b"}`` mapping or a tree carrying adapters."""
    flat = adapters_of(grads) if has_adapters(grads) else grads
    return sorted(path for path, g in flat.items() if not bool(jnp.any(g["b"] != 0)))
