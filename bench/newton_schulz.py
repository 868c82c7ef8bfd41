"""Newton-Schulz on a preset's Muon leaves: the standard iteration (``X ← aX + (bG + cG²)X``)
against the Gram formulation that ``formulation="auto"`` picks (``zaya_jax.ops.newton_schulz``),
through :func:`zaya_jax.optim.orthogonalize` as the train step calls it (``impl="reference"``, the
leaf's stack axes flattened into a batch).

Per leaf: each formulation jitted alone and timed interleaved with the other (median of
``--repeats`` rounds, each round runs both), FLOPs of one call, and the largest absolute and the
relative Frobenius difference of the outputs. ``total``: all leaves in one jitted function (as in
the train step), timed the same way. Inputs are Gaussian momenta of the leaves' shapes. Also the
temporaries XLA plans (``memory_analysis``) per leaf and for all leaves, and with ``--memory-preset``
(e.g. ``configs/zaya1-8b.yaml``) those of another preset's leaves, compiled from shapes only
(nothing allocated, nothing run). Prints one JSON object.

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
FORMULATIONS = ("standard", "auto")


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


def leaf_flops(shape, matrix_axes, formulation: str) -> tuple[str, int]:
    fan_in, fan_out = shape[matrix_axes[0]], shape[matrix_axes[1]]
    m, n = min(fan_in, fan_out), max(fan_in, fan_out)
    batch = int(np.prod(shape)) // (m * n)
    chosen = resolve_formulation(formulation, m, n, full_float32_matmuls())
    if formulation == "auto" and fan_in > fan_out:  # newton_schulz: auto keeps tall ones standard
        chosen = "standard"
    flops = gram_flops(m, n, STEPS, GRAM_RESTART) if chosen == "gram" else standard_flops(m, n, STEPS)
    return chosen, batch * flops


def temp_mib(fn, *args) -> float:
    """Temporaries of ``fn`` compiled for ``args`` (arrays or ShapeDtypeStructs), MiB."""
    return round(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20, 3)


def memory_only(preset: str) -> dict:
    """Per-leaf and all-leaves temporaries of both formulations for ``preset``'s Muon leaves."""
    leaves = muon_leaves(preset)
    specs = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, (shape, _) in leaves.items()}
    out = {"preset": preset, "leaves": {}}
    for name, (shape, matrix_axes) in leaves.items():
        row = {"shape": list(shape), "new_formulation": leaf_flops(shape, matrix_axes, "auto")[0]}
        for f, key in zip(FORMULATIONS, ("old", "new"), strict=True):
            fn = jax.jit(lambda x, f=f, ax=matrix_axes: orthogonalize(x, ax, NS_COEFFS, STEPS, formulation=f))
            row[f"{key}_temp_mib"] = temp_mib(fn, specs[name])
        out["leaves"][name] = row
    for f, key in zip(FORMULATIONS, ("old", "new"), strict=True):
        fn = jax.jit(
            lambda xs, f=f: {
                n: orthogonalize(x, leaves[n][1], NS_COEFFS, STEPS, formulation=f) for n, x in xs.items()
            }
        )
        out[f"all_leaves_{key}_temp_mib"] = temp_mib(fn, specs)
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

    def orth(name, formulation):
        return lambda x: orthogonalize(x, leaves[name][1], NS_COEFFS, STEPS, formulation=formulation)

    result = {
        "preset": args.preset,
        "backend": jax.default_backend(),
        "steps": STEPS,
        "restart": GRAM_RESTART,
    }
    per_leaf = {}
    for name, (shape, matrix_axes) in leaves.items():
        fns = {f: jax.jit(orth(name, f)) for f in FORMULATIONS}
        ms = interleaved(fns, (inputs[name],), args.repeats)
        outs = {f: np.asarray(fn(inputs[name])) for f, fn in fns.items()}
        diff = outs["auto"] - outs["standard"]
        chosen, new_flops = leaf_flops(shape, matrix_axes, "auto")
        _, old_flops = leaf_flops(shape, matrix_axes, "standard")
        per_leaf[name] = {
            "shape": list(shape),
            "new_formulation": chosen,
            "old_ms": round(ms["standard"], 3),
            "new_ms": round(ms["auto"], 3),
            "ratio": round(ms["auto"] / ms["standard"], 3),
            "old_gflop": round(old_flops / 1e9, 4),
            "new_gflop": round(new_flops / 1e9, 4),
            "max_abs_diff": float(np.abs(diff).max()),
            "rel_fro_diff": float(np.linalg.norm(diff) / np.linalg.norm(outs["standard"])),
            "old_temp_mib": temp_mib(fns["standard"], inputs[name]),
            "new_temp_mib": temp_mib(fns["auto"], inputs[name]),
        }
    result["leaves"] = per_leaf

    def all_leaves(formulation):
        return jax.jit(lambda xs: {name: orth(name, formulation)(x) for name, x in xs.items()})

    fns = {f: all_leaves(f) for f in FORMULATIONS}
    ms = interleaved(fns, (inputs,), args.repeats)
    old = sum(v["old_gflop"] for v in per_leaf.values())
    new = sum(v["new_gflop"] for v in per_leaf.values())
    result["total"] = {
        "old_ms": round(ms["standard"], 3),
        "new_ms": round(ms["auto"], 3),
        "ratio": round(ms["auto"] / ms["standard"], 3),
        "sum_of_leaves_old_ms": round(sum(v["old_ms"] for v in per_leaf.values()), 3),
        "sum_of_leaves_new_ms": round(sum(v["new_ms"] for v in per_leaf.values()), 3),
        "old_gflop": round(old, 4),
        "new_gflop": round(new, 4),
        "flop_ratio": round(new / old, 3),
        "max_abs_diff": max(v["max_abs_diff"] for v in per_leaf.values()),
        "max_rel_fro_diff": max(v["rel_fro_diff"] for v in per_leaf.values()),
        "old_temp_mib": temp_mib(fns["standard"], inputs),
        "new_temp_mib": temp_mib(fns["auto"], inputs),
    }
    if args.memory_preset:
        result["memory"] = memory_only(args.memory_preset)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
