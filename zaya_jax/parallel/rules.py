"""The logical-axis rules table: which mesh axes split each logical axis name.

Model code names every parameter axis (``zaya_jax.model.layers``) and knows nothing of meshes;
this table alone decides the layout. The defaults come from the registry of logical axes
(``zaya_jax.model.axes``): ``embed`` over ``fsdp``, ``experts`` over ``expert``, ``batch`` over
(``data``, ``fsdp``, ``expert``), ``seq`` over ``context``, ``vocab_parallel`` over ``fsdp``, the rest
replicated.

``mesh.rules`` in the config overrides entries, e.g. ``{name: vocab, mesh: [fsdp]}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zaya_jax.config import ConfigError, MeshConfig, ModelConfig
from zaya_jax.lora.plan import EVERY_PARAMETER, ParameterPlan
from zaya_jax.model.axes import AXES, BATCH_AXES

if TYPE_CHECKING:
    import optax

# The default table, from the registry (zaya_jax.model.axes): logical name -> mesh axes.
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = tuple((axis.name, axis.mesh) for axis in AXES)
# The mesh axes over which ZeRO-1 splits the optimizer state: those whose devices hold the same
# parameters and see different tokens (rows over data, positions of the same rows over context).
ZERO1_AXES = ("data", "context")


def logical_rules(mesh_cfg: MeshConfig) -> tuple[tuple[str, Any], ...]:
    """The default table with ``mesh_cfg.rules`` applied, in Flax's ``(name, mesh axes)`` form."""
    table = dict(DEFAULT_RULES)
    for rule in mesh_cfg.rules:
        if rule.name not in table:
            raise ConfigError(
                f"mesh.rules names the logical axis {rule.name!r}, which the model does not have; use one of "
                f"{sorted(table)} (zaya_jax.model.axes)"
            )
        table[rule.name] = tuple(rule.mesh)
    return tuple((name, axes if axes else None) for name, axes in table.items())


def logical_to_spec(
    names: Sequence[str | None], rules: Sequence[tuple[str, Any]], mesh: Mesh
) -> PartitionSpec:
    """A PartitionSpec for an array whose axes carry logical ``names``; mesh axes of size 1 dropped."""
    table = dict(rules)
    spec = []
    for name in names:
        axes = table.get(name) if name is not None else None
        axes = tuple(a for a in (axes or ()) if mesh.shape[a] > 1)
        spec.append(axes if len(axes) > 1 else (axes[0] if axes else None))
    return PartitionSpec(*spec)


def batch_spec(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> PartitionSpec:
    """The PartitionSpec of a (batch, seq) array: its logical axes ``batch`` and ``seq`` under
    ``rules`` (by default rows over data x fsdp x expert, positions over context)."""
    return logical_to_spec(BATCH_AXES, rules, mesh)


def variable_shardings(
    model_cfg: ModelConfig,
    mesh: Mesh,
    rules: Sequence[tuple[str, Any]],
    parameters: ParameterPlan | None = None,
) -> dict[str, Any]:
    """NamedShardings of the model's ``{"params", "balancing"}`` from their logical axis names, with
    the adapters the parameter plan adds (each factor split like its weight).

    An axis whose size the mesh axes do not divide stays replicated rather than failing.
    """
    boxed = (parameters or EVERY_PARAMETER).boxed(model_cfg)

    def sharding(leaf: nn.LogicallyPartitioned | jax.ShapeDtypeStruct) -> NamedSharding:
        if isinstance(leaf, nn.LogicallyPartitioned):
            shape, names = leaf.value.shape, leaf.names
        else:
            shape, names = leaf.shape, (None,) * len(leaf.shape)
        spec = list(logical_to_spec(names, rules, mesh))
        for i, axes in enumerate(spec):
            size = 1
            for axis in (axes,) if isinstance(axes, str) else axes or ():
                size *= mesh.shape[axis]
            if shape[i] % size:
                spec[i] = None
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree.map(sharding, boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def matching_shardings(
    tree: optax.OptState, params: dict[str, Any], param_shardings: dict[str, Any], mesh: Mesh
) -> Any:
    """Shardings for an optimizer-state-like ``tree``: a leaf whose key path ends with a parameter's
    path and has its shape gets that parameter's sharding; anything else (counts, scalars) is
    replicated."""
    by_path = {}
    for (path, p), s in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(param_shardings), strict=True
    ):
        by_path[tuple(path)] = (p.shape, s)
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path, leaf):
        path = tuple(path)
        for start in range(len(path)):
            hit = by_path.get(path[start:])
            if hit is not None and hit[0] == getattr(leaf, "shape", None):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree)


def zero1_shardings(
    params: dict[str, Any],
    param_shardings: dict[str, Any],
    mesh: Mesh,
    axes: Sequence[str] = ZERO1_AXES,
) -> dict[str, Any]:
    """ZeRO-1: each parameter's sharding with the mesh ``axes`` that hold replicas of it on
    different tokens (``data``, and ``context``: its devices hold other positions of the same rows)
    added, one at a time, each to the first dimension that the split so far times the axis divides
    (the stacked layers or experts of a weight before its matrix axes, so distributed Muon keeps
    whole matrices per device). An axis that no dimension takes, or that already splits the
    parameter, is left out. The optimizer state, gradients and update take these."""

    def split(param: jax.ShapeDtypeStruct, sharding: NamedSharding) -> NamedSharding:
        spec = list(sharding.spec) + [None] * (len(param.shape) - len(sharding.spec))
        entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
        added = False
        for axis in axes:
            size = mesh.shape[axis]
            if size == 1 or any(axis in names for names in entries):  # nothing to add, or split already
                continue
            for dim, names in enumerate(entries):
                held = int(np.prod([mesh.shape[n] for n in names])) if names else 1
                if param.shape[dim] % (held * size) == 0:
                    entries[dim], added = (*names, axis), True
                    break
        if not added:
            return sharding
        return NamedSharding(mesh, PartitionSpec(*(names or None for names in entries)))

    return jax.tree.map(split, params, param_shardings)


__all__ = [
    "DEFAULT_RULES",
    "ZERO1_AXES",
    "batch_spec",
    "logical_rules",
    "logical_to_spec",
    "matching_shardings",
    "variable_shardings",
    "zero1_shardings",
]
