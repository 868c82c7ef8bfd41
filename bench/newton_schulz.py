"""Newton-Schulz on a preset's Muon leaves through :func:`zaya_jax.optim.orthogonalize` as the train
step calls it (the leaf's stack axes flattened into a batch): the JAX loop's standard iteration
(``X <- aX + (bG + cG^2)X``), the JAX loop with ``formulation="auto"`` (the Gram formulation for
wide leaves of aspect >= 4; ``zaya_jax.ops.newton_schulz``), what the train step ran on a CPU
before the kernel, and the CPU custom call (``zaya_jax.ops.newton_schulz_cpu``), which it runs now.

Per leaf: each variant jitted alone and timed interleaved with the others (median of ``--repeats``
rounds, each round runs all), the formulation, the FLOPs of one call as that variant counts them
(the kernel computes only the upper blocks of its symmetric products), GFLOP/s, the relative
Frobenius difference from the standard JAX loop, and the temporaries XLA plans (the kernel's
scratch is its own, per worker). ``total``: all leaves in one jitted function (as in the train
step), timed the same way. Inputs are Gaussian momenta of the leaves' shapes. With
``--memory-preset`` (e.g. ``configs/zaya1-8b.yaml``) also the JAX loop's temporaries for another
preset's leaves, compiled from shapes only (nothing allocated, nothing run). Prints one JSON object.

    taskset -c 1 python bench/newton_schulz.py [--preset tiny] [--repeats 21] [--memory-preset P]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax import load_config
from zaya_jax.config import NS_COEFFS
from zaya_jax.ops import newton_schulz_cpu
from zaya_jax.ops.newton_schulz import (
    GRAM_RESTART,
    full_float32_matmuls,
    gram_flops,
    resolve_formulation,
    standard_flops,
)
from zaya_jax.optim import orthogonalize
from zaya_jax.optim.groups import describe_groups

STEPS = 5
# name -> (impl, formulation): the JAX loop's standard iteration, the JAX loop as the train step ran
# it before the CPU kernel (auto: Gram for wide leaves of aspect >= 4), and the CPU kernel (auto:
# the formulation with fewer FLOPs), which the train step runs on a CPU now.
VARIANTS = {"jax_standard": ("jax", "standard"), "jax_auto": ("jax", "auto"), "kernel": ("reference", "auto")}


def muon_leaves(preset: str) -> dict[str, tuple[tuple[int, ...], tuple[int, int]]]:
    """name -> (shape, matrix_axes as indices) of every Muon leaf of the preset's model."""
    out = {}
    for name, info in describe_groups(load_config(preset).model).items():
        if info["group"] != "muon":
            continue
        axes = list(info["axes"])
        matrix_axes = (axes.index(info["matrix_axes"][0]), axes.index(info["matrix_axes"][1]))
        out[name] = (tuple(info["shape"]), matrix_axes)
    return out


def leaf_flops(shape, matrix_axes, variant: str) -> tuple[str, int]:
    impl, formulation = VARIANTS[variant]
    fan_in, fan_out = shape[matrix_axes[0]], shape[matrix_axes[1]]
    m, n = min(fan_in, fan_out), max(fan_in, fan_out)
    batch = int(np.prod(shape)) // (m * n)
    if impl == "reference":
        chosen = newton_schulz_cpu.resolve(formulation, m, n, STEPS)
        return chosen, batch * newton_schulz_cpu.flops(m, n, STEPS, chosen)
    chosen = resolve_formulation(formulation, m, n, full_float32_matmuls())
    if formulation == "auto" and fan_in > fan_out:  # newton_schulz: auto keeps tall ones standard
        chosen = "standard"
    flops = gram_flops(m, n, STEPS, GRAM_RESTART) if chosen == "gram" else standard_flops(m, n, STEPS)
    return chosen, batch * flops


def orth_fn(matrix_axes, variant: str):
    impl, formulation = VARIANTS[variant]
    return lambda x: orthogonalize(x, matrix_axes, NS_COEFFS, STEPS, impl=impl, formulation=formulation)


def temp_mib(fn, *args) -> float:
    """Temporaries of ``fn`` compiled for ``args`` (arrays or ShapeDtypeStructs), MiB."""
    return round(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20, 3)


def memory_only(preset: str) -> dict:
    """Per-leaf and all-leaves temporaries of the JAX loop's formulations for ``preset``'s Muon leaves
    (the kernel's scratch is its own, per worker, and XLA does not plan it)."""
    leaves = muon_leaves(preset)
    specs = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, (shape, _) in leaves.items()}
    out = {"preset": preset, "leaves": {}}
    jax_variants = ("jax_standard", "jax_auto")
    for name, (shape, matrix_axes) in leaves.items():
        row = {"shape": list(shape), "jax_auto_formulation": leaf_flops(shape, matrix_axes, "jax_auto")[0]}
        for v in jax_variants:
            row[f"{v}_temp_mib"] = temp_mib(jax.jit(orth_fn(matrix_axes, v)), specs[name])
        out["leaves"][name] = row
    for v in jax_variants:
        fn = jax.jit(lambda xs, v=v: {n: orth_fn(leaves[n][1], v)(x) for n, x in xs.items()})
        out[f"all_leaves_{v}_temp_mib"] = temp_mib(fn, specs)
    return out


def interleaved(fns: dict, args, repeats: int) -> dict[str, float]:
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compile
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--memory-preset", default=None, help="also planned temporaries of this preset")
    args = parser.parse_args()
    leaves = muon_leaves(args.preset)
    rng = np.random.default_rng(0)
    inputs = {
        name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, (shape, _) in leaves.items()
    }

    variants = [v for v in VARIANTS if v != "kernel" or newton_schulz_cpu.available()]
    result = {
        "preset": args.preset,
        "backend": jax.default_backend(),
        "steps": STEPS,
        "restart": GRAM_RESTART,
        "variants": {v: VARIANTS[v] for v in variants},
    }
    per_leaf = {}
    for name, (shape, matrix_axes) in leaves.items():
        fns = {v: jax.jit(orth_fn(matrix_axes, v)) for v in variants}
        ms = interleaved(fns, (inputs[name],), args.repeats)
        outs = {v: np.asarray(fn(inputs[name]), np.float64) for v, fn in fns.items()}
        base = outs["jax_standard"]
        row = {"shape": list(shape)}
        for v in variants:
            chosen, flops = leaf_flops(shape, matrix_axes, v)
            diff = outs[v] - base
            row[v] = {
                "formulation": chosen,
                "ms": round(ms[v], 3),
                "gflop": round(flops / 1e9, 4),
                "gflop_per_s": round(flops / ms[v] / 1e6, 1),
                "rel_fro_diff_vs_jax_standard": float(np.linalg.norm(diff) / np.linalg.norm(base)),
                "temp_mib": temp_mib(fns[v], inputs[name]),
            }
        per_leaf[name] = row
    result["leaves"] = per_leaf

    def all_leaves(v):
        return jax.jit(lambda xs: {name: orth_fn(leaves[name][1], v)(x) for name, x in xs.items()})

    fns = {v: all_leaves(v) for v in variants}
    ms = interleaved(fns, (inputs,), args.repeats)
    total = {}
    for v in variants:
        gflop = sum(row[v]["gflop"] for row in per_leaf.values())
        total[v] = {
            "ms": round(ms[v], 3),
            "sum_of_leaves_ms": round(sum(row[v]["ms"] for row in per_leaf.values()), 3),
            "gflop": round(gflop, 4),
            "gflop_per_s": round(gflop / ms[v] * 1e3, 1),
            "max_rel_fro_diff_vs_jax_standard": max(
                row[v]["rel_fro_diff_vs_jax_standard"] for row in per_leaf.values()
            ),
        }
        total[v]["time_vs_jax_auto"] = round(ms[v] / ms["jax_auto"], 3)
    result["total"] = total
    if args.memory_preset:
        result["memory"] = memory_only(args.memory_preset)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
