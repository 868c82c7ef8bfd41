"""Which parameters Muon optimises, and which of their axes form the matrix, from logical axis names.

Every parameter carries logical axis names (``zaya_jax/model/layers.py``); one table below gives each
name a role, and the group of a leaf follows from the roles of its axes alone, never from module
names (MaxText's name-based mapping silently mis-grouped new expert layouts). A leaf is **Muon** iff,
after dropping its ``batch`` axes, exactly two axes remain and both are ``matrix`` axes; everything
else is **AdamW**. The kernel layout is (..., in, out), so the first matrix axis is the reduction
(input) axis and the second the output axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec

from zaya_jax.config import ModelConfig
from zaya_jax.model.axes import AXES, AxisRole

Group = Literal["muon", "adamw"]

# One role per parameter axis name, from the registry (zaya_jax.model.axes, which says why).
_AXIS_ROLES: dict[str, AxisRole] = {axis.name: axis.role for axis in AXES if axis.role is not None}
# The router's hidden widths; ``router_group="adamw"`` moves matrices over them out of Muon.
_ROUTER_AXES = frozenset({"router", "router_mlp"})

LogicalAxes = tuple[str | None, ...]


@dataclass(frozen=True)
class LeafGroup:
    """How the optimizer treats one parameter leaf.

    ``group``: ``"muon"`` or ``"adamw"``. ``matrix_axes``: for Muon, the (reduction/input,
    output) axis indices in the leaf's own axes (all other axes are batch axes); ``None`` for
    AdamW. ``decay``: whether the group's weight decay applies (always for Muon; for AdamW only
    leaves with two or more non-stack axes, i.e. weight matrices/tables, not norms, biases, scales).
    """

    group: Group
    matrix_axes: tuple[int, int] | None
    decay: bool = True

    def __post_init__(self) -> None:
        if self.group not in ("muon", "adamw"):
            raise ValueError(f"LeafGroup.group must be 'muon' or 'adamw', got {self.group!r}")
        if (self.group == "muon") != (self.matrix_axes is not None):
            raise ValueError(
                f"LeafGroup({self.group!r}, matrix_axes={self.matrix_axes}): Muon leaves need "
                "(input, output) matrix axes and AdamW leaves none"
            )


def is_leaf_group(x: Any) -> bool:
    return isinstance(x, LeafGroup)


def _is_axes_leaf(x: Any) -> bool:
    """A leaf of a logical-axes tree: a PartitionSpec or a tuple of axis names (possibly empty)."""
    return isinstance(x, PartitionSpec) or (
        isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
    )


def _role(name: str | None, path: str) -> AxisRole:
    if name is None:
        return "adamw"  # an unnamed axis cannot be shown to be a hidden width
    if not isinstance(name, str):
        raise ValueError(
            f"parameter {path}: axis name {name!r} is not a single logical name; the optimizer groups "
            "need one name per dimension"
        )
    try:
        return _AXIS_ROLES[name]
    except KeyError:
        raise ValueError(
            f"parameter {path} has logical axis {name!r}, which the optimizer group table does not "
            f"know (known: {', '.join(_AXIS_ROLES)}); add it to _AXIS_ROLES in zaya_jax/optim/groups.py"
        ) from None


def leaf_group(axes: LogicalAxes, router_group: Group = "muon", path: str = "<leaf>") -> LeafGroup:
    """The group of one leaf from its logical axis names (one per dimension)."""
    roles = [_role(name, path) for name in axes]
    rest = [i for i, role in enumerate(roles) if role != "batch"]
    decay = len(rest) >= 2
    is_matrix = len(rest) == 2 and all(roles[i] == "matrix" for i in rest)
    if is_matrix and router_group == "adamw" and any(axes[i] in _ROUTER_AXES for i in rest):
        is_matrix = False
    if not is_matrix:
        return LeafGroup("adamw", None, decay)
    return LeafGroup("muon", (rest[0], rest[1]), True)


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_groups(logical_axes_tree: dict[str, Any], router_group: Group = "muon") -> dict[str, Any]:
    """Map a tree of logical axis names (PartitionSpecs or tuples, e.g. ``param_logical_axes(cfg)``)
    to the same-structure tree of :class:`LeafGroup`.

    ``router_group="adamw"`` sends the router's down-projection and R x R MLP to AdamW.
    """
    if router_group not in ("muon", "adamw"):
        raise ValueError(f"router_group must be 'muon' or 'adamw', got {router_group!r}")
    return jax.tree_util.tree_map_with_path(
        lambda path, axes: leaf_group(tuple(axes), router_group, _path_str(path)),
        logical_axes_tree,
        is_leaf=_is_axes_leaf,
    )


def group_labels(groups_tree: dict[str, Any]) -> dict[str, Any]:
    """The ``"muon"``/``"adamw"`` label tree ``optax.partition`` takes."""
    return jax.tree.map(lambda g: g.group, groups_tree, is_leaf=is_leaf_group)


def _abstract_params(model_cfg: ModelConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(logical-axes tree of PartitionSpecs, ShapeDtypeStruct tree) of the model's params; no allocation."""
    # the model imports nothing from optim; keep it one-way
    from zaya_jax.model.transformer import boxed_abstract_variables

    boxed = boxed_abstract_variables(model_cfg)
    return nn.get_partition_spec(boxed)["params"], nn.unbox(boxed)["params"]


def param_logical_axes(model_cfg: ModelConfig) -> dict[str, Any]:
    """The tree of logical axis names (PartitionSpec leaves) of ``Zaya(model_cfg)``'s params."""
    return _abstract_params(model_cfg)[0]


def model_param_groups(
    model_cfg: ModelConfig, router_group: Group = "muon", matrix_optimizer: Group = "muon"
) -> dict[str, Any]:
    """``param_groups`` of ``Zaya(model_cfg)``'s params (same structure as ``variables["params"]``);
    ``matrix_optimizer="adamw"`` sends every Muon matrix to AdamW (with weight decay)."""
    groups = param_groups(param_logical_axes(model_cfg), router_group)
    if matrix_optimizer == "adamw":
        groups = jax.tree.map(
            lambda g: LeafGroup("adamw", None, True) if g.group == "muon" else g,
            groups,
            is_leaf=is_leaf_group,
        )
    return groups


def describe_groups(model_cfg: ModelConfig, router_group: Group = "muon") -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer groups for ``zaya inspect --optimizer --json``.

    Keys are "/"-joined param paths (``layers/experts/wi``); values hold ``group``, ``matrix_axes``
    (the names of the (input, output) axes, or None), ``batch_axes`` (Muon: every other axis;
    AdamW: the stack axes ``layers``/``experts`` not counted when deciding weight decay),
    ``weight_decay`` (bool), ``axes`` (all logical names) and ``shape``.
    """
    specs, shapes = _abstract_params(model_cfg)
    groups = param_groups(specs, router_group)
    flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_axes_leaf)[0]
    flat_groups = jax.tree.leaves(groups, is_leaf=is_leaf_group)
    flat_shapes = jax.tree.leaves(shapes)
    out: dict[str, dict[str, Any]] = {}
    for (path, axes), group, shape in zip(flat_specs, flat_groups, flat_shapes, strict=True):
        names = list(axes)
        if group.matrix_axes is not None:
            matrix = [names[i] for i in group.matrix_axes]
            batch = [n for i, n in enumerate(names) if i not in group.matrix_axes]
        else:
            matrix = None
            batch = [n for n in names if n is not None and _AXIS_ROLES.get(n) == "batch"]
        out[_path_str(path)] = {
            "group": group.group,
            "matrix_axes": matrix,
            "batch_axes": batch,
            "weight_decay": group.decay,
            "axes": names,
            "shape": list(shape.shape),
        }
    return out
