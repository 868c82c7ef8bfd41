"""Building the device mesh from ``cfg.mesh`` and placing arrays on it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zaya_jax.config import MESH_AXES, Config, ConfigError, MeshConfig
from zaya_jax.parallel.rules import DEFAULT_RULES, batch_spec


def mesh_sizes(mesh_cfg: MeshConfig, device_count: int) -> dict[str, int]:
    """Axis sizes with the -1 axis filled so that their product is ``device_count``."""
    sizes = mesh_cfg.sizes()
    fixed = math.prod(size for size in sizes.values() if size > 0)
    auto = [axis for axis, size in sizes.items() if size == -1]
    if auto:
        if device_count % fixed:
            raise ConfigError(
                f"{device_count} devices cannot be split into mesh axes {sizes}: the fixed axes' product "
                f"{fixed} does not divide the device count; change the fixed sizes"
            )
        sizes[auto[0]] = device_count // fixed
    elif fixed != device_count:
        raise ConfigError(
            f"mesh axes {sizes} multiply to {fixed} but {device_count} devices are present; "
            "set one axis to -1 to fill the rest"
        )
    return sizes


def make_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh (data, fsdp, expert, context) over ``devices`` (default: all), validated against the
    config's batch, sequence and expert sizes.

    Devices are laid out so the innermost axes (expert, context) stay within a process (a node)
    where possible: ``mesh_utils.create_hybrid_device_mesh`` splits the data axis across processes.
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = mesh_sizes(cfg.mesh, len(devices))
    cfg.validate_layout(sizes)
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    processes = len({d.process_index for d in devices})
    if processes > 1 and sizes["data"] % processes == 0:
        per_process = list(shape)
        per_process[0] //= processes
        array = mesh_utils.create_hybrid_device_mesh(
            per_process,
            (processes, 1, 1, 1),
            devices=devices,
            process_is_granule=True,
            allow_split_physical_axes=True,
        )
    else:
        try:
            array = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            array = np.asarray(devices).reshape(shape)
    return Mesh(array, MESH_AXES)


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]] = DEFAULT_RULES) -> NamedSharding:
    """(batch, seq) arrays: by default rows over data x fsdp x expert, the sequence over context
    (:func:`~zaya_jax.parallel.rules.batch_spec`)."""
    return NamedSharding(mesh, batch_spec(mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's share of a global host batch (all of it in a single-process run)."""
    count, index = jax.process_count(), jax.process_index()
    rows = next(iter(batch.values())).shape[0] // count
    return {k: v[index * rows : (index + 1) * rows] for k, v in batch.items()}


def process_local(tree: Any) -> Any:
    """``tree``'s arrays usable by this process alone (e.g. by a sampler that runs on this
    process's devices while the others run theirs). An array already addressable here is kept; one
    whose sharding splits it only over mesh axes that lie within a process (replicated across
    processes: the default layout, where the data axis spans processes) becomes the same shards on
    this process's part of the mesh, without a copy; any other (split across processes, e.g. an
    fsdp axis spanning them) is gathered whole (``process_allgather``, a collective every process
    makes in the same order) and placed on this process's devices, replicated."""
    from jax.experimental import multihost_utils

    def local(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        part = _local_part(x.sharding)  # this process's block of the mesh (None: not one block)
        if part is not None:
            mesh, spec = x.sharding.mesh, x.sharding.spec
            axes = [
                a
                for entry in spec
                if entry is not None
                for a in (entry if isinstance(entry, tuple) else (entry,))
            ]
            if all(part.shape[a] == mesh.shape[a] for a in axes):
                shards = [s.data for s in x.addressable_shards]
                return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(part, spec), shards)
        value = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        # on the same devices, in the same order, as the arrays kept in place
        if part is None:
            part = Mesh(np.asarray(jax.local_devices()), ("local",))
        return jax.device_put(value, NamedSharding(part, PartitionSpec()))

    return jax.tree.map(local, tree)


def _local_part(sharding: Any) -> Mesh | None:
    """The block of a NamedSharding's mesh that this process's devices form, or None."""
    if not isinstance(sharding, NamedSharding):
        return None
    try:
        return sharding.mesh.local_mesh
    except ValueError:  # this process's devices are not one block of the mesh
        return None


def put_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Host rows of this process -> global arrays. Each process passes its own slice of the global
    batch (``jax.make_array_from_process_local_data``); one process passes the whole batch."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}
