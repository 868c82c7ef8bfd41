"""Window caches for sliding-window layers against full-length caches, in one run: the slot cache's
bytes, and the time of one engine decode step (one new token in each of ``--slots`` rows, every row
near the end of its ``--capacity`` positions) with each layout, the variants interleaved.

The model is the ``--config`` preset with every other layer a sliding one (``--window`` keys). With
window caches (:func:`zaya_jax.model.init_cache`, the engine's default) a sliding layer keeps a ring
of ``--window`` positions per row and attends to it; with full-length caches (``window_caches=False``)
it keeps every position and masks by distance. Both give the same logits (checked here, and by
``tests/test_generate.py`` and ``tests/engine/test_engine.py`` against the full forward and the
static sampler).

    python bench/window_cache.py [--config tiny] [--slots 16] [--capacity 2048] [--window 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import zaya_jax
from zaya_jax.model import Zaya, init_cache, init_variables


def filled(cfg, variables, prompts: np.ndarray, capacity: int, windowed: bool, chunk: int = 256) -> dict:
    """A slot cache with ``prompts`` (slots, used) read in, ``chunk`` tokens at a time."""
    cache = init_cache(cfg, prompts.shape[0], capacity, per_row=True, window_caches=windowed)
    read = jax.jit(lambda v, t, c: Zaya(cfg).apply(v, t, cache=c)[1]["cache"])
    for start in range(0, prompts.shape[1], chunk):
        cache = read(variables, jnp.asarray(prompts[:, start : start + chunk]), cache)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = zaya_jax.load_config(args.config).model
    types = tuple("hybrid_sliding" if i % 2 else "hybrid" for i in range(base.num_layers))
    cfg = dataclasses.replace(base, layer_types=types, sliding_window=args.window)
    variables = init_variables(cfg, seed=0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (args.slots, 1)), jnp.int32)
    used = (args.capacity - 2 * args.steps * args.rounds - 1) // 256 * 256
    prompts = rng.integers(3, cfg.vocab_size, (args.slots, used)).astype(np.int32)

    @jax.jit
    def step(variables, cache):
        logits, aux = Zaya(cfg).apply(variables, tokens, cache=cache)
        return logits, aux["cache"]

    variants = {"window": True, "full": False}
    caches = {name: filled(cfg, variables, prompts, args.capacity, w) for name, w in variants.items()}
    nbytes = {name: sum(x.nbytes for x in c.values()) for name, c in caches.items()}
    first = {name: step(variables, c) for name, c in caches.items()}  # compile; the same logits
    gap = float(jnp.max(jnp.abs(first["window"][0] - first["full"][0])))
    caches = {name: out[1] for name, out in first.items()}
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            cache = caches[name]
            jax.block_until_ready(cache)
            start = time.perf_counter()
            for _ in range(args.steps):
                _, cache = step(variables, cache)
            jax.block_until_ready(cache)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            caches[name] = cache
    best = {name: min(t) for name, t in times.items()}
    print(
        json.dumps(
            {
                "config": args.config,
                "layers": cfg.num_layers,
                "sliding_layers": types.count("hybrid_sliding"),
                "slots": args.slots,
                "capacity": args.capacity,
                "positions_used": used,
                "window": args.window,
                "cache_mib": {k: round(v / 2**20, 2) for k, v in nbytes.items()},
                "step_ms": {k: round(v, 2) for k, v in best.items()},
                "step_ms_all": {k: [round(x, 2) for x in v] for k, v in times.items()},
                "speedup": round(best["full"] / best["window"], 2),
                "max_logit_gap": gap,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
