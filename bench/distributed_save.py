"""Distributed checkpoint saves, measured: every process writing its own shards (Orbax, as
``zaya train`` saves) against one process gathering the whole state and writing it, on the same
sharded state.

Two processes of 4 CPU devices each (``jax.distributed`` on this host) hold ``--mib`` MiB of
float32 in eight arrays sharded over the 8-device mesh (FSDP-style: each device a slice). Variants,
alternated for ``--rounds`` rounds, each started by every process after a barrier and timed on
process 0 until every process is done and its bytes are on disk (``os.sync``, a barrier after):

- ``sharded``: ``ocp.StandardCheckpointer`` (TensorStore/OCDBT, one file set per process): each
  process writes only the shards it holds, in parallel.
- ``gathered``: ``multihost_utils.process_allgather`` of every array, then process 0 alone writes
  them (``np.save`` + ``fsync``): the naive save the seed article's ">10x" is measured against.
- ``sharded_local``: ``sharded`` into ``--local-dir`` (a RAM disk, ``/dev/shm``): the local tier's
  storage (``checkpoint.local_dir``) against the persistent tier's (``--dir``, the run's disk).

    python bench/distributed_save.py [--mib 256] [--rounds 3] [--dir /tmp/zaya_dist_save]
        [--local-dir /dev/shm/zaya_dist_save]

On 2 CPU cores both processes share the cores and the disk; the GPU row comes from bench/gpu.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def _noise(array: int, row: int, rows: int):
    """Random float32 rows: incompressible, as trained weights are (Orbax compresses what it writes,
    so a constant array would measure nothing)."""
    import numpy as np

    return np.random.default_rng([array, row]).standard_normal((rows, 1024), np.float32)


def _child(args: argparse.Namespace) -> None:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=2, process_id=args.process_id)
    mesh = Mesh(np.asarray(jax.devices()).reshape(8), ("fsdp",))
    sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    rows = args.mib * 2**20 // 4 // 8 // 1024  # eight arrays of (rows, 1024) float32
    rows -= rows % 8
    state = {
        f"layer_{i}": jax.make_array_from_callback(
            (rows, 1024), sharding, lambda index, i=i: _noise(i, index[0].start or 0, rows // 8)
        )
        for i in range(8)
    }
    root = Path(args.dir)
    times: dict[str, list[float]] = {"sharded": [], "gathered": [], "sharded_local": []}

    def sharded(target: Path) -> None:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(target, state)
            ckptr.wait_until_finished()

    def gathered(target: Path) -> None:
        full = {name: multihost_utils.process_allgather(array, tiled=True) for name, array in state.items()}
        if jax.process_index() == 0:
            target.mkdir(parents=True)
            for name, array in full.items():
                with open(target / f"{name}.npy", "wb") as f:
                    np.save(f, np.asarray(array))
                    f.flush()
                    os.fsync(f.fileno())

    for round_ in range(args.rounds):
        for name, save in (("sharded", sharded), ("gathered", gathered), ("sharded_local", sharded)):
            target = (Path(args.local_dir) if name == "sharded_local" else root) / f"{name}-{round_}"
            multihost_utils.sync_global_devices(f"start {name} {round_}")
            start = time.perf_counter()
            save(target)
            os.sync()  # durable, as the gathered variant's fsync: Orbax leaves its files in the page cache
            multihost_utils.sync_global_devices(f"end {name} {round_}")
            times[name].append(time.perf_counter() - start)
    if jax.process_index() == 0:
        print(json.dumps({"mib": args.mib, "times": times}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/zaya_dist_save")
    parser.add_argument("--local-dir", default="/dev/shm/zaya_dist_save")
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_id is not None:
        _child(args)
        return
    for directory in (args.dir, args.local_dir):
        shutil.rmtree(directory, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    command = [
        sys.executable, __file__, f"--mib={args.mib}", f"--rounds={args.rounds}", f"--dir={args.dir}",
        f"--local-dir={args.local_dir}",
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*command, f"--process-id={i}", f"--port={port}"], stdout=subprocess.PIPE, text=True, env=env
        )
        for i in range(2)
    ]
    out = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a process failed: {[p.returncode for p in procs]}")
    result = json.loads(out[0].strip().splitlines()[-1])
    best = {name: min(t) for name, t in result["times"].items()}
    print(f"{result['mib']} MiB sharded over 8 devices in 2 processes; best of {args.rounds}, alternated")
    print("| save | best s | median s | MiB/s |")
    print("|---|---|---|---|")
    for name, t in result["times"].items():
        median = sorted(t)[len(t) // 2]
        print(f"| {name} | {best[name]:.2f} | {median:.2f} | {result['mib'] / best[name]:.0f} |")
    print(f"gathered / sharded (best): {best['gathered'] / best['sharded']:.2f}x")
    print(f"sharded, persistent / local tier (best): {best['sharded'] / best['sharded_local']:.2f}x")
    for directory in (args.dir, args.local_dir):
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
