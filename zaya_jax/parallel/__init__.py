"""Meshes, the logical-axis rules table and the sharded layouts of parameters, optimizer state and
batches (``zaya_jax.parallel.rules``, ``zaya_jax.parallel.mesh``)."""

from zaya_jax.parallel.layout import Layout, make_layout, program_hooks
from zaya_jax.parallel.mesh import (
    batch_sharding,
    local_rows,
    make_mesh,
    mesh_sizes,
    process_local,
    put_batch,
    replicated,
)
from zaya_jax.parallel.rules import (
    DEFAULT_RULES,
    batch_spec,
    logical_rules,
    logical_to_spec,
    matching_shardings,
    variable_shardings,
)

__all__ = [
    "DEFAULT_RULES",
    "Layout",
    "batch_sharding",
    "batch_spec",
    "local_rows",
    "logical_rules",
    "logical_to_spec",
    "make_layout",
    "make_mesh",
    "matching_shardings",
    "mesh_sizes",
    "process_local",
    "program_hooks",
    "put_batch",
    "replicated",
    "variable_shardings",
]
