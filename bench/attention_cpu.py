"""Attention forward + backward on CPU: the fused custom call (``attention_impl: cpu``) and the JAX
blocked kernel against PyTorch's ``scaled_dot_product_attention`` (causal, GQA), each framework in
its own process, the processes alternating over ``--rounds`` rounds (best round kept per variant).

Each variant computes ``grad`` of ``sum(w * attention(q, k, v))`` with respect to q, k and v at
(batch x seq, ``--heads`` nq,nk,d), float32, a causal mask (the mask PyTorch's fused kernel takes;
the custom call walks the same key blocks for any CCA mask). Prints one JSON object: milliseconds
per variant and shape, and ``speedup_vs_torch`` (torch time / variant time, > 1: faster).

    python bench/attention_cpu.py [--shapes 1x8192 2x2048 16x128] [--rounds 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HEADS = "4,2,32"  # the `tiny` preset's attention: 4 query heads, 2 KV heads of 32


def _shapes(text: list[str]) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in s.split("x")) for s in text]


def _inputs(batch, seq, nq, nk, d):
    import numpy as np

    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((batch, seq, nq, d)).astype("float32"),
        rng.standard_normal((batch, seq, nk, d)).astype("float32"),
        rng.standard_normal((batch, seq, nk, d)).astype("float32"),
        rng.standard_normal((batch, seq, nq, d)).astype("float32"),
    )


def _time(fn, repeats: int) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _time_jax_shape(batch, seq, heads, repeats) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from zaya_jax.ops.attention import blocked_attention, self_attention_mask
    from zaya_jax.ops.attention.cpu import cpu_attention

    q, k, v, w = (jnp.asarray(x) for x in _inputs(batch, seq, *heads))
    mask = self_attention_mask(seq)
    kernels = {
        "cpu": lambda q, k, v: cpu_attention(q, k, v, mask)[0],
        "blocked": lambda q, k, v: blocked_attention(q, k, v, mask, block=128)[0],
    }
    times = {}
    for name, kernel in kernels.items():
        step = jax.jit(jax.grad(lambda q, k, v, f=kernel: jnp.sum(w * f(q, k, v)), argnums=(0, 1, 2)))
        times[name] = _time(lambda: jax.block_until_ready(step(q, k, v)), repeats)  # noqa: B023 - called now
    return times


def measure_jax(shapes, heads, repeats) -> dict[str, dict[str, float]]:
    from zaya_jax.ops.attention.cpu import available

    if not available():
        raise SystemExit(
            "the CPU custom call is not built: pip install -e . (or python custom_calls/build.py)"
        )
    results: dict[str, dict[str, float]] = {"cpu": {}, "blocked": {}}
    for batch, seq in shapes:
        for name, ms in _time_jax_shape(batch, seq, heads, repeats).items():
            results[name][f"{batch}x{seq}"] = ms
    return results


def measure_torch(shapes, heads, repeats) -> dict[str, dict[str, float]]:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    results: dict[str, dict[str, float]] = {"torch_sdpa": {}}
    for batch, seq in shapes:
        q, k, v, w = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in _inputs(batch, seq, *heads))

        def step(q=q, k=k, v=v, w=w):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            (out * w).sum().backward()

        results["torch_sdpa"][f"{batch}x{seq}"] = _time(step, repeats)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1x8192", "2x2048", "16x128"])
    parser.add_argument("--heads", default=HEADS, help="nq,nk,d")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--framework", choices=["jax", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes, heads = _shapes(args.shapes), tuple(int(x) for x in args.heads.split(","))
    if args.framework:
        measure = measure_jax if args.framework == "jax" else measure_torch
        print(json.dumps(measure(shapes, heads, args.repeats)))
        return
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for framework in ("jax", "torch"):
            command = [sys.executable, __file__, "--framework", framework, "--shapes", *args.shapes,
                       "--heads", args.heads, "--repeats", str(args.repeats)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            for name, times in json.loads(done.stdout.splitlines()[-1]).items():
                for shape, ms in times.items():
                    best.setdefault(name, {})[shape] = min(ms, best.get(name, {}).get(shape, float("inf")))
            print(f"{framework}: {done.stdout.splitlines()[-1]}", file=sys.stderr, flush=True)
    torch_ms = best["torch_sdpa"]
    speedup = {
        name: {s: round(torch_ms[s] / ms, 3) for s, ms in times.items()} for name, times in best.items()
    }
    ms = {name: {s: round(t, 1) for s, t in times.items()} for name, times in best.items()}
    print(json.dumps({"heads": args.heads, "ms": ms, "speedup_vs_torch": speedup}, indent=2))


if __name__ == "__main__":
    main()
