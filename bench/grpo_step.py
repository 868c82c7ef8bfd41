"""Trained completion tokens per second of GRPO's train step on an RL-shaped workload: one row per
completion padded to ``train.seq_len`` (the default) against completions packed several to a row
(``rl.pack``).

The workload is ``bench/engine.py``'s: 64 prompts of 16-128 tokens, 8 completions each (512), their
lengths log-normal (median 48, clipped to 4-256). ``train.seq_len`` holds the longest prompt plus
the longest completion (384); a step trains ``--batch`` completions (64: 8 steps per rollout). Each
variant's rows are built by zaya's own row builders (``completion_row``, ``packed_rows``) with random
sampler log-probabilities, routes and advantages, and its jitted train step (the ``grpo`` program
as ``zaya train`` compiles it, once per row count) runs over the rollout's steps; the variants are
timed alternately, ``--rounds`` times, best kept. Completion tokens/s = the rollout's completion
tokens over the time of its steps.

    python bench/grpo_step.py [--config tiny] [--batch 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import zaya_jax
from zaya_jax.objectives import build_programs
from zaya_jax.objectives.rollout_rows import Completion, completion_row, packed_rows

SEQ = 384


def workload(vocab: int, layers: int, classes: int, seed: int = 0) -> list[Completion]:
    rng = np.random.default_rng(seed)
    completions = []
    for p in range(64):
        prompt = rng.integers(3, vocab, int(rng.integers(16, 129)))
        for _ in range(8):
            n = int(np.clip(rng.lognormal(np.log(48), 0.9), 4, 256))
            tokens = rng.integers(3, vocab, n)
            routes = rng.integers(0, classes, (len(prompt) + n - 1, layers))
            completions.append(Completion(p, prompt, tokens, -rng.uniform(0.1, 3.0, n), 0.0, routes))
    return completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batch", type=int, default=64, help="completions per step")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = [f"train.seq_len={SEQ}", f"train.batch_size={args.batch}", "train.objective=grpo"]
    base += ["balancing.enabled=false", "rl.reward=zaya_jax.rewards:exact_match"]
    cfg = zaya_jax.load_config(args.config, base)
    model = cfg.model
    completions = workload(model.vocab_size, model.num_layers, model.num_experts + 1)
    advantages = np.random.default_rng(1).normal(size=len(completions)).astype(np.float32)
    completion_tokens = sum(len(c.tokens) for c in completions)
    programs = build_programs(cfg, devices=jax.devices()[:1])
    variants = {}
    for name in ("one per row", "packed"):
        batches = []
        for i in range(0, len(completions), args.batch):
            part, adv = completions[i : i + args.batch], advantages[i : i + args.batch]
            if name == "packed":
                rows = packed_rows(cfg, part, adv, 0, model.vocab_size)
            else:
                rows = [
                    completion_row(cfg, c, float(a), 0, model.vocab_size)
                    for c, a in zip(part, adv, strict=True)
                ]
            batches.append({k: np.stack([r[k] for r in rows]) for k in rows[0]})
        variants[name] = batches
    state = [programs.init_state()]

    def run(batches) -> None:
        for batch in batches:
            state[0], metrics = programs.train_step(*programs.step_arguments(state[0], batch))
        jax.block_until_ready(metrics)

    for batches in variants.values():  # compile every row count, warm up
        run(batches)
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.rounds):
        for name, batches in variants.items():
            began = time.perf_counter()
            run(batches)
            best[name] = min(best[name], time.perf_counter() - began)
    out = {
        "config": args.config, "completions": len(completions), "completion_tokens": completion_tokens,
        "seq_len": SEQ, "batch": args.batch,
    }  # fmt: skip
    for name, batches in variants.items():
        rows = sum(len(b["inputs"]) for b in batches)
        read = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
        out[name] = {
            "rows": rows, "row_fill": round(read / (rows * SEQ), 3), "seconds": round(best[name], 2),
            "completion_tokens_per_s": round(completion_tokens / best[name]),
        }  # fmt: skip
    out["packed_speedup"] = round(best["one per row"] / best["packed"], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
