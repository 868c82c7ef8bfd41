"""How much memory a compiled program plans and a device has, before anything is allocated: the
fit checks before a run (:mod:`zaya_jax.train.fit`) and the MoE path timing (:mod:`.moe`, which
does not run a candidate whose plan would not fit) share these numbers.

- **Plan**: XLA's buffer assignment of a compiled program (arguments + temporaries + outputs -
  aliased), the number ``--compile-only`` prints as ``peak_bytes_per_device``.
- **Capacity**: ``runtime.memory_limit_gb`` where set, else the backend's ``bytes_limit`` on a
  GPU, else on CPU the host's available RAM (``MemAvailable``), shared by the host's devices.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

GB = 1e9


def peak_bytes(memory: Any) -> int:
    """Arguments + temporaries + outputs - aliased (donated) bytes: a compiled program's per-device
    peak as XLA's buffer assignment plans it."""
    return int(
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )


def available_host_bytes() -> int | None:
    """The host's available RAM (``MemAvailable``), or None when it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def device_capacity(memory_limit_gb: float = 0.0, device: jax.Device | None = None) -> tuple[int | None, str]:
    """(bytes one device may use, where the number comes from); None when unknown."""
    if memory_limit_gb > 0:
        return int(memory_limit_gb * GB), "runtime.memory_limit_gb"
    device = device or jax.local_devices()[0]
    if device.platform != "cpu":
        limit = (device.memory_stats() or {}).get("bytes_limit")
        return (int(limit), f"{device.device_kind} memory") if limit else (None, "unknown")
    available = available_host_bytes()
    if available is None:
        return None, "unknown"
    count = jax.local_device_count()
    return available // count, "host RAM available" + (f" / {count} devices" if count > 1 else "")


def tree_bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of abstract arrays carrying their shardings (``abstract_state``)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = (
            leaf.sharding.shard_shape(leaf.shape)
            if getattr(leaf, "sharding", None) is not None
            else leaf.shape
        )
        total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
    return total
