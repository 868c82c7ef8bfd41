"""Every MoE compute path, forward + backward, at one expert layer's shapes (default: ZAYA1-8B's, 16
experts, hidden 2048, ``moe_intermediate_size`` 2048, top-1, bf16) on this machine's first device.

Paths: ``sorted`` (``jax.lax.ragged_dot`` on GPUs, the blocked batched matmul on CPU), on ROCm also
``sorted`` compiled with ``xla_gpu_experimental_use_ragged_dot_grouped_gemm`` (hipBLASLt grouped
GEMM), ``blocked`` (the CPU's blocked batched matmul, on any device), ``dense`` (every expert on
every token), ``capacity`` (expert-major gather, ``--capacity-factor`` slots; drops) and
``capacity_one_hot`` (the same slots through one-hot dispatch einsums, as before). Tokens are
routed uniformly over the experts and the skip class. Each path is compiled once and timed in
rounds that interleave the paths (best round kept); the table reports ms, useful TFLOP/s (18 · h ·
I per routed token: three matmuls of the SwiGLU expert, forward and backward) and the ratio to
``sorted``, and each program's planned temporaries. Prints one JSON object.

    python bench/moe_paths.py [--tokens 8192] [--hidden 2048] [--inner 2048] [--experts 16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.model.experts import (
    blocked_grouped_matmul,
    capacity_experts,
    dense_experts,
    one_hot_capacity_experts,
    sorted_experts,
)

GROUPED_GEMM = {"xla_gpu_experimental_use_ragged_dot_grouped_gemm": True}


def _blocked_experts(x, choice, weight, wi, wo, act):
    """``sorted`` with the blocked matmul forced (the CPU path) on any device."""
    experts = wi.shape[0]
    order = jnp.argsort(choice, stable=True)
    sizes = jnp.bincount(choice, length=experts + 1)[:experts].astype(jnp.int32)
    gate, up = jnp.split(blocked_grouped_matmul(x[order], wi, sizes), 2, axis=-1)
    out = blocked_grouped_matmul(jax.nn.silu(gate) * up, wo, sizes) * weight[order][:, None]
    return jnp.zeros_like(out).at[order].set(out)


def paths(capacity_factor: float, experts: int, tokens: int) -> dict:
    capacity = max(1, int(np.ceil(capacity_factor * tokens / experts)))

    def capacity_path(x, choice, weight, wi, wo, act):
        return capacity_experts(x[None], choice[None], weight[None], wi, wo, act, capacity)[0][0]

    def capacity_one_hot(x, choice, weight, wi, wo, act):
        return one_hot_capacity_experts(x[None], choice[None], weight[None], wi, wo, act, capacity)[0]

    return {
        "sorted": sorted_experts,
        "blocked": _blocked_experts,
        "dense": dense_experts,
        "capacity": capacity_path,
        "capacity_one_hot": capacity_one_hot,
    }


def compile_path(fn, args, options=None):
    def loss(x, weight, wi, wo, choice):
        return jnp.sum(fn(x, choice, weight, wi, wo, "silu").astype(jnp.float32))

    def step(x, choice, weight, wi, wo):
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, weight, wi, wo, choice)

    lowered = jax.jit(step).lower(*args)
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def _temp_mib(program) -> float | None:
    memory = program.memory_analysis()
    return None if memory is None else round(memory.temp_size_in_bytes / 2**20, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    t, h, i, e = args.tokens, args.hidden, args.inner, args.experts
    choice = rng.integers(0, e + 1, size=t).astype(np.int32)
    host = (
        rng.standard_normal((t, h)),
        choice,
        rng.random(t),
        rng.standard_normal((e, h, 2 * i)) / np.sqrt(h),
        rng.standard_normal((e, i, h)) / np.sqrt(i),
    )
    args_ = tuple(
        jax.device_put(jnp.asarray(a, jnp.int32 if a.dtype == np.int32 else dtype), device) for a in host
    )
    compiled, skipped = {}, {}
    rocm = "rocm" in str(getattr(device.client, "platform_version", "")).lower()
    variants = {name: (fn, None) for name, fn in paths(args.capacity_factor, e, t).items()}
    if rocm:
        variants["sorted_grouped_gemm"] = (variants["sorted"][0], GROUPED_GEMM)
    for name, (fn, options) in variants.items():
        try:
            compiled[name] = compile_path(fn, args_, options)
            jax.block_until_ready(compiled[name](*args_))
        except Exception as err:  # a path this platform cannot compile (memory, an unknown option)
            skipped[name] = str(err).splitlines()[0][:200]
            compiled.pop(name, None)
    best = dict.fromkeys(compiled, float("inf"))
    for _ in range(args.rounds):
        for name, program in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(program(*args_))
            best[name] = min(best[name], time.perf_counter() - start)
    routed = int((choice < e).sum())
    useful = 18 * h * i * routed
    reference = best.get("sorted")
    report = {
        "device": f"{device.platform}:{device.device_kind}",
        "shape": {"tokens": t, "routed": routed, "hidden": h, "inner": i, "experts": e, "dtype": dtype.name},
        "ms": {n: round(s * 1e3, 3) for n, s in best.items()},
        "useful_tflops": {n: round(useful / s / 1e12, 2) for n, s in best.items()},
        "vs_sorted": {n: round(s / reference, 3) for n, s in best.items()} if reference else None,
        "temp_mib": {n: _temp_mib(program) for n, program in compiled.items()},
        "skipped": skipped,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
