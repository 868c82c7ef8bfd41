"""Custom-call kernels against their XLA references on this machine's CPU (the CPU twins):
the fused residual-scaling + RMSNorm (forward, and forward+backward) and the batched Newton-Schulz
iteration. Prints one JSON line of times and ratios (custom / reference; < 1 means the kernel is
faster). Both are timed in the same run, interleaved, best of N.

    python bench/kernels.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from zaya_jax import ops
from zaya_jax.config import NS_COEFFS


def best(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--small", action="store_true", help="small shapes (a plumbing check, not a speed)")
    args = parser.parse_args()
    backend = jax.default_backend()
    assert ops.registered("cuda" if backend == "gpu" else backend), (
        "build the kernels first (pip install -e .)"
    )
    out = {"backend": jax.default_backend()}

    rows, width = (512, 256) if args.small else (8192, 1024)  # 4 x 2048 tokens at ZAYA1-8B's half width
    keys = jax.random.split(jax.random.key(0), 7)
    f = jax.random.normal(keys[0], (rows, width))
    h = jax.random.normal(keys[1], (rows, width))
    params = [1.0 + 0.1 * jax.random.normal(k, (width,)) for k in keys[2:]]
    for impl in ("custom", "reference"):
        fwd = jax.jit(lambda f, h, *p, impl=impl: ops.residual_rms_norm(f, h, *p, eps=1e-5, impl=impl))
        grad = jax.jit(
            jax.grad(
                lambda f, h, *p, impl=impl: jnp.sum(
                    ops.residual_rms_norm(f, h, *p, eps=1e-5, impl=impl)[1] ** 2
                ),
                argnums=tuple(range(7)),
            )
        )
        out[f"norm_fwd_{impl}_s"] = best(fwd, f, h, *params, repeats=args.repeats)
        out[f"norm_fwd_bwd_{impl}_s"] = best(grad, f, h, *params, repeats=args.repeats)

    coeffs = NS_COEFFS
    shapes = (
        (("ns_2x64x128", (2, 64, 128)),)
        if args.small
        else (("ns_8x256x512", (8, 256, 512)), ("ns_2x1024x1024", (2, 1024, 1024)))
    )
    for name, shape in shapes:
        x = jax.random.normal(keys[0], shape)
        x = x / jnp.linalg.norm(x, axis=(-2, -1), keepdims=True)
        for impl in ("custom", "reference"):
            fn = jax.jit(lambda x, impl=impl: ops.newton_schulz_iterations(x, 5, coeffs, impl=impl))
            out[f"{name}_{impl}_s"] = best(fn, x, repeats=max(2, args.repeats // 2))
    for key in [k for k in out if k.endswith("_custom_s")]:
        out[key.replace("_custom_s", "_ratio")] = round(
            out[key] / out[key.replace("_custom_s", "_reference_s")], 3
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
