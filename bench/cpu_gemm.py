"""The CPU grouped-GEMM custom call against what XLA:CPU does without it, at the ``--config``
preset's shapes, in one process, interleaved, medians over ``--rounds`` rounds: the dropless MoE's
grouped matmul (``zaya_jax.ops.grouped_matmul``) over ``--tokens`` rows split unevenly over the
experts, forward (x @ w), input gradient (dy @ wᵀ) and weight gradient (xᵀ @ dy), against the
blocked form it replaces (forward, and forward + both gradients) and one plain XLA matmul with the
same FLOPs (the machine's matmul roofline). Muon's Newton-Schulz kernel against XLA's loop:
``bench/newton_schulz.py``.

Prints one JSON object: milliseconds and GFLOP/s per case.

    python bench/cpu_gemm.py [--config tiny] [--tokens 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import zaya_jax
from zaya_jax.model.experts import blocked_grouped_matmul
from zaya_jax.ops import grouped_matmul


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not grouped_matmul.available():
        raise SystemExit("the CPU kernel library is not built: python custom_calls/build.py")
    cfg = zaya_jax.load_config(args.config).model
    rng = np.random.default_rng(0)
    report = {"config": args.config, "tokens": args.tokens, "grouped": {}}

    for name, case in grouped_cases(cfg, args.tokens, rng).items():
        ms = _interleaved(case.pop("cases"), args.rounds)
        flop = case["gflop_per_product"]
        gflops = {k: round(flop * (3 if "backward" in k else 1) / v * 1e3) for k, v in ms.items()}
        report["grouped"][name] = {**case, "ms": ms, "gflop_s": gflops}

    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
