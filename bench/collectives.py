"""The collectives a training step uses (all-reduce, reduce-scatter, all-gather, all-to-all) as bus
bandwidth over message sizes on the devices present, in the convention of nccl-tests / rccl-tests
(``busbw = algbw · 2(n-1)/n`` for all-reduce, ``· (n-1)/n`` for the others, ``algbw`` = the
message's bytes per device / time), so numbers compare with the interconnect's rated bandwidth.

Each collective runs inside ``shard_map`` over a one-axis mesh of every device, jitted and timed
as the best of ``--rounds`` runs. With one device nothing moves (the table says so). On CPU, run
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for a plumbing check. Prints one JSON
object.

    python bench/collectives.py [--mib 1 16 256] [--dtype bfloat16] [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "d"


def programs(mesh: Mesh) -> dict:
    n = mesh.size

    def sharded(fn):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec(AXIS), out_specs=PartitionSpec(AXIS))
        )

    return {
        "all_reduce": (sharded(lambda x: jax.lax.psum(x, AXIS)), 2 * (n - 1) / n),
        "reduce_scatter": (sharded(lambda x: jax.lax.psum_scatter(x, AXIS, tiled=True)), (n - 1) / n),
        "all_gather": (sharded(lambda x: jax.lax.all_gather(x, AXIS, tiled=True)), (n - 1) / n),
        "all_to_all": (sharded(lambda x: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True)), (n - 1) / n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", nargs="+", type=float, default=[1, 16, 256], help="bytes per device")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), (AXIS,))
    dtype = jnp.dtype(args.dtype)
    report = {"devices": n, "device": devices[0].device_kind, "dtype": dtype.name, "busbw_gb_s": {}}
    if n == 1:
        report["note"] = "one device: no collective moves data"
    for mib in args.mib:
        # per device: a multiple of n elements (reduce-scatter and all-to-all split it n ways)
        count = max(n, int(mib * 2**20 / dtype.itemsize) // n * n)
        nbytes = count * dtype.itemsize
        sharding = NamedSharding(mesh, PartitionSpec(AXIS))
        full = jax.device_put(jnp.ones((n * count,), dtype), sharding)  # ``count`` per device
        part = jax.device_put(jnp.ones((count,), dtype), sharding)  # gathered into ``count`` per device
        row = {}
        for name, (fn, factor) in programs(mesh).items():
            arg = part if name == "all_gather" else full
            jax.block_until_ready(fn(arg))
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                jax.block_until_ready(fn(arg))
                best = min(best, time.perf_counter() - start)
            row[name] = round(nbytes / best * factor / 1e9, 2) if n > 1 else None
        report["busbw_gb_s"][f"{nbytes / 2**20:g} MiB"] = row
        print(json.dumps({f"{nbytes / 2**20:g} MiB": row}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
