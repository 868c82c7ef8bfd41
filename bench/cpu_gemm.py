"""The CPU GEMM custom calls against what XLA:CPU does without them, at the ``--config`` preset's
shapes, in one process, interleaved, medians over ``--rounds`` rounds:

* ``grouped``: the dropless MoE's grouped matmul (``zaya_jax.ops.grouped_matmul``) over
  ``--tokens`` rows split unevenly over the experts, forward (x @ w), input gradient (dy @ wᵀ) and
  weight gradient (xᵀ @ dy), against the blocked form it replaces (forward, and forward + both
  gradients) and one plain XLA matmul with the same FLOPs (the machine's matmul roofline);
* ``batched``: Newton–Schulz's products over a stack of expert matrices (``G X``, ``G G``,
  ``X Xᵀ``), ``zaya_jax.ops.batched_matmul`` against ``jnp.matmul``, with whether the bits agree;
* ``muon``: the orthogonalisation of every Muon leaf of the preset, as the optimizer runs it, with
  the custom products and with XLA's.

Prints one JSON object: milliseconds and GFLOP/s per case.

    python bench/cpu_gemm.py [--config tiny] [--tokens 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import zaya_jax
from zaya_jax.model.experts import blocked_grouped_matmul
from zaya_jax.ops import batched_matmul, grouped_matmul
from zaya_jax.optim.groups import is_leaf_group, model_param_groups
from zaya_jax.optim.muon import orthogonalize


def _median_ms(fn, *args, repeats=9):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _interleaved(cases: dict, rounds: int) -> dict[str, float]:
    for fn, args in cases.values():  # compile and warm up
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    per_round = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (fn, args) in cases.items():
            per_round[name].append(_median_ms(fn, *args))
    return {name: round(statistics.median(ms), 3) for name, ms in per_round.items()}


def _grouped_programs(x, w, dy, sizes, rows):
    """The timed programs of one expert projection: x (tokens, K), w (E, K, N), dy (tokens, N)."""

    def both(fn):  # forward and both gradients of <fn(x, w), dy>
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.vdot(fn(x, w, sizes), dy), argnums=(0, 1)))

    return {
        "forward": (jax.jit(lambda x, w: grouped_matmul._product(x, w, sizes, False)), (x, w)),
        "input_grad": (jax.jit(lambda dy, w: grouped_matmul._product(dy, w, sizes, True)), (dy, w)),
        "weight_grad": (jax.jit(lambda x, dy: grouped_matmul._weight_grad(x, dy, sizes, w.shape)), (x, dy)),
        "blocked_forward": (jax.jit(lambda x, w: blocked_grouped_matmul(x, w, sizes)), (x, w)),
        "custom_forward_backward": (both(grouped_matmul.cpu_grouped_matmul), (x, w)),
        "blocked_forward_backward": (both(blocked_grouped_matmul), (x, w)),
        "xla_plain_matmul": (jax.jit(lambda x, w: x[:rows] @ w[0]), (x, w)),
    }


def grouped_cases(cfg, tokens, rng):
    experts, embed, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shares = rng.dirichlet(np.full(experts, 4.0)) * tokens * 0.95  # 5% skip-routed
    sizes = jnp.asarray(np.floor(shares), jnp.int32)
    rows = int(sizes.sum())
    out = {}
    for name, (k, n) in {"wi": (embed, 2 * inner), "wo": (inner, embed)}.items():
        x = jnp.asarray(rng.normal(size=(tokens, k)), jnp.float32)
        w = jnp.asarray(rng.normal(size=(experts, k, n)), jnp.float32)
        dy = jnp.asarray(rng.normal(size=(tokens, n)), jnp.float32)
        out[name] = {
            "rows": rows,
            "k": k,
            "n": n,
            "gflop_per_product": 2 * rows * k * n / 1e9,
            "cases": _grouped_programs(x, w, dy, sizes, rows),
        }
    return out


def batched_cases(cfg, rng):
    stack, m, n = cfg.num_layers * cfg.num_experts, cfg.hidden_size, 2 * cfg.moe_intermediate_size
    x = jnp.asarray(rng.normal(size=(stack, m, n)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(stack, m, m)), jnp.float32)
    t = lambda a: jnp.swapaxes(a, -1, -2)  # noqa: E731
    mm = batched_matmul.matmul
    return {
        "G X": ((lambda x, g: g @ x), (lambda x, g: mm(g, x)), 2 * stack * m * m * n),
        "G G": ((lambda x, g: g @ g), (lambda x, g: mm(g, g)), 2 * stack * m**3),
        "X Xt": ((lambda x, g: x @ t(x)), (lambda x, g: mm(x, x, transpose_b=True)), 2 * stack * m * m * n),
    }, (x, g)


def muon_leaves(cfg):
    """The preset's Muon leaves and their (input, output) matrix axes, as the optimizer groups them."""
    params = zaya_jax.model.init_variables(cfg, 0)["params"]
    groups = jax.tree.leaves(model_param_groups(cfg), is_leaf=is_leaf_group)
    pairs = [
        (leaf, g.matrix_axes)
        for leaf, g in zip(jax.tree.leaves(params), groups, strict=True)
        if g.group == "muon"
    ]
    return [leaf for leaf, _ in pairs], [axes for _, axes in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not (grouped_matmul.available() and batched_matmul.available()):
        raise SystemExit("the CPU kernel library is not built: python custom_calls/build.py")
    cfg = zaya_jax.load_config(args.config).model
    rng = np.random.default_rng(0)
    report = {"config": args.config, "tokens": args.tokens, "grouped": {}, "batched": {}}

    for name, case in grouped_cases(cfg, args.tokens, rng).items():
        ms = _interleaved(case.pop("cases"), args.rounds)
        flop = case["gflop_per_product"]
        gflops = {k: round(flop * (3 if "backward" in k else 1) / v * 1e3) for k, v in ms.items()}
        report["grouped"][name] = {**case, "ms": ms, "gflop_s": gflops}

    products, operands = batched_cases(cfg, rng)
    for name, (xla, custom, flop) in products.items():
        xla_fn, custom_fn = jax.jit(xla), jax.jit(custom)
        ms = _interleaved({"xla": (xla_fn, operands), "custom": (custom_fn, operands)}, args.rounds)
        same = bool(jnp.all(xla_fn(*operands) == custom_fn(*operands)))
        gflops = {k: round(flop / v / 1e6) for k, v in ms.items()}
        report["batched"][name] = {"ms": ms, "gflop_s": gflops, "same_bits": same}

    leaves, axes = muon_leaves(cfg)

    def update(leaves):
        return [orthogonalize(leaf, ax) for leaf, ax in zip(leaves, axes, strict=True)]

    with_custom = jax.jit(update)
    with_custom.lower(leaves)  # traced with the custom products
    with mock.patch.object(batched_matmul, "available", lambda: False):
        with_xla = jax.jit(lambda leaves: update(leaves)).lower(leaves).compile()
    report["muon"] = _interleaved(
        {"custom": (with_custom, (leaves,)), "xla": (with_xla, (leaves,))}, args.rounds
    )
    report["muon"]["ratio"] = round(report["muon"]["custom"] / report["muon"]["xla"], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
