"""Attention work per device under context parallelism: contiguous shards against the zig-zag
layout (``mesh.context_layout``), measured per device.

Every device runs the same SPMD program, whose conditionals (which ring hops a device computes)
depend on its index, so one program cannot tell the devices apart. This bench compiles each
device's program separately: the ring's per-device function (forward and backward) with the
device index a constant (``jax.lax.axis_index`` patched) and the hops' exchanges as identities,
so XLA folds the conditionals; then it times each device's program on one CPU core's worth of
work (median of ``--repeats``). XLA's ``cost_analysis()["flops"]`` is printed beside it but is
not the measure: it counts a while loop's body once, not once per trip, so the blocked kernel's
key-block loop is undercounted (a 256 x 512 hop reads as cheap as 256 x 256).

    python bench/context_balance.py [--seq 4096] [--block 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp

from zaya_jax.parallel import ring

REPEATS = 5
LAYOUTS = {"contiguous": ring._ring_local, "zigzag": ring._zigzag_ring_local}


def device_program(layout: str, size: int, me: int, seq: int, block: int) -> tuple[float, float]:
    """(median seconds of forward + backward, XLA's flop count) of device ``me``'s ring."""
    local = seq // size
    q = jnp.zeros((1, local, 4, 32), jnp.float32)
    kv = jnp.zeros((1, local, 2, 32), jnp.float32)
    seg = jnp.ones((1, local), jnp.int32)
    real = jnp.ones((1, local), bool)

    def program(q, k, v, seg, real):
        def loss(q, k, v):
            out = LAYOUTS[layout](q, k, v, seg, seg, real, None, axis="context", size=size, block=block)
            return jnp.sum(out * out)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with (
        mock.patch.object(jax.lax, "axis_index", lambda axis: jnp.int32(me)),
        mock.patch.object(jax.lax, "ppermute", lambda x, axis, perm: x),
    ):
        compiled = jax.jit(program).lower(q, kv, kv, seg, real).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    args = (q + 0.01, kv + 0.02, kv + 0.03, seg, real)
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), float(cost["flops"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    global REPEATS
    REPEATS = args.repeats
    print(
        f"sequence {args.seq}, 4 query / 2 kv heads of 32, block {args.block}; forward + backward per device\n"
    )
    print("| context | layout | ms per device | max / min | XLA flops max / min (loop bodies once) |")
    print("|---|---|---|---|---|")
    for size in (4, 8):
        for layout in LAYOUTS:
            runs = [device_program(layout, size, me, args.seq, args.block) for me in range(size)]
            ms = [t * 1e3 for t, _ in runs]
            flops = [f for _, f in runs]
            cells = " ".join(f"{x:.0f}" for x in ms)
            print(
                f"| {size} | {layout} | {cells} | {max(ms) / min(ms):.2f} | {max(flops) / min(flops):.2f} |"
            )


if __name__ == "__main__":
    main()
