"""Checkpoint speed against raw disk I/O, measured in one run.

Saves a parameter-like tree (``--mib`` MiB of float32 in stacked layer arrays) with the project's
checkpoint manager: synchronous save time vs ``np.save`` + ``fsync`` of the same bytes, the time an
asynchronous save blocks the caller, restore time vs ``np.load``, and the cost of verification:
the array fingerprints computed when a save starts and again after a restore
(``zaya_jax.checkpoint.fingerprint``), against the restore itself (best of 3, interleaved). Usage:

    python bench/checkpoint_speed.py [--mib 512] [--dir /tmp/zaya_ckpt_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from zaya_jax import checkpoint
from zaya_jax.checkpoint.fingerprint import fingerprints


def _tree(mib: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    per_leaf = mib * 2**20 // 4 // 8  # eight leaves of float32
    return {f"layers_{i}": rng.standard_normal((8, per_leaf // 8), dtype=np.float32) for i in range(8)}


def _raw_write(tree: dict[str, np.ndarray], directory: Path) -> float:
    directory.mkdir(parents=True)
    start = time.perf_counter()
    for name, array in tree.items():
        with open(directory / f"{name}.npy", "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def _raw_read(tree: dict[str, np.ndarray], directory: Path) -> float:
    start = time.perf_counter()
    for name in tree:
        np.load(directory / f"{name}.npy")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--dir", default="/tmp/zaya_ckpt_bench")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    tree = jax.tree.map(jax.numpy.asarray, _tree(args.mib))
    host = jax.tree.map(np.asarray, tree)

    warm = checkpoint.manager(root / "warm")  # first-save costs (imports, thread pools) out of the way
    warm.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(tree)))
    warm.wait_until_finished()

    raw_write = _raw_write(host, root / "raw")
    sync = checkpoint.manager(root / "sync")
    start = time.perf_counter()
    sync.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(tree)))
    sync.wait_until_finished()
    sync_save = time.perf_counter() - start

    asynchronous = checkpoint.manager(root / "async", async_save=True)
    start = time.perf_counter()
    asynchronous.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(tree)))
    async_block = time.perf_counter() - start
    asynchronous.wait_until_finished()
    async_total = time.perf_counter() - start

    raw_read = _raw_read(host, root / "raw")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    fingerprints(tree)  # compiled once per tree structure; the runs below reuse it
    restores, verifies = [], []
    for _ in range(3):  # interleaved: the machine is shared and noisy
        start = time.perf_counter()
        restored = sync.restore(1, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
        restores.append(time.perf_counter() - start)
        start = time.perf_counter()
        fingerprints(restored["params"])
        verifies.append(time.perf_counter() - start)
    restore, verify = min(restores), min(verifies)

    report = {
        "mib": args.mib,
        "raw_write_s": round(raw_write, 3),
        "sync_save_s": round(sync_save, 3),
        "sync_save_over_raw_write": round(sync_save / raw_write, 2),
        "async_blocking_s": round(async_block, 3),
        "async_total_s": round(async_total, 3),
        "raw_read_s": round(raw_read, 3),
        "restore_s": round(restore, 3),
        "restore_over_raw_read": round(restore / raw_read, 2),
        "fingerprint_s": round(verify, 3),
        "fingerprint_over_restore": round(verify / restore, 3),
        "fingerprint_gib_per_s": round(args.mib / 1024 / verify, 2),
    }
    print(json.dumps(report, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
