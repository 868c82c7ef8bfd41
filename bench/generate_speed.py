"""Decoding with the CCA cache against recomputing the full forward for every new token, in one run.

Both produce the same greedy tokens (checked). The reference runs one jitted full forward over a
fixed-length buffer per new token (no recompilation, no cache); the cached path is
``zaya_jax.generate.generate`` (one prefill, then a jitted while_loop of one-token steps).
Usage:

    python bench/generate_speed.py [--config tiny] [--batch 4] [--prompt 128] [--new 128]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import zaya_jax
from zaya_jax.generate import generate
from zaya_jax.model import Zaya, init_variables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    cfg = zaya_jax.load_config(args.config).model
    variables = init_variables(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg.vocab_size, (args.batch, args.prompt)).astype(np.int32)

    def cached():
        return generate(cfg, variables, prompts, max_new_tokens=args.new, stop_tokens=[]).tokens

    total = args.prompt + args.new
    forward = jax.jit(lambda v, ids: Zaya(cfg).apply(v, ids)[0])

    def recompute():
        buffer = np.zeros((args.batch, total), np.int32)
        buffer[:, : args.prompt] = prompts
        for t in range(args.prompt, total):  # causal: positions past t do not change logits at t - 1
            logits = forward(variables, jnp.asarray(buffer))
            buffer[:, t] = np.asarray(jnp.argmax(logits[:, t - 1], axis=-1))
        return buffer[:, args.prompt :]

    timings = {}
    for name, fn in [("cached", cached), ("recompute", recompute)]:
        fn()  # compile
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - start)
        timings[name] = (best, out)
    same = bool(np.array_equal(timings["cached"][1], timings["recompute"][1]))
    new_tokens = args.batch * args.new
    print(
        json.dumps(
            {
                "config": args.config,
                "batch": args.batch,
                "prompt": args.prompt,
                "new_tokens_per_row": args.new,
                "cached_s": timings["cached"][0],
                "recompute_s": timings["recompute"][0],
                "cached_tokens_per_s": new_tokens / timings["cached"][0],
                "recompute_tokens_per_s": new_tokens / timings["recompute"][0],
                "speedup": timings["recompute"][0] / timings["cached"][0],
                "same_tokens": same,
                "backend": jax.default_backend(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
