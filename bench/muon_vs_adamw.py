"""Train-step time with Muon+AdamW (the default groups) against all-AdamW, in one run.

Same model, batch and data; the two optimizers' jitted steps are timed alternately (best of N after warm-up) at two
batch sizes. Prints step times and the ratio Muon/AdamW. Usage:

    python bench/muon_vs_adamw.py [--config tiny] [--tokens 1024 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import zaya_jax
from zaya_jax.data import load_tokenizer, make_row_iterator, next_batch
from zaya_jax.objectives import build_programs
from zaya_jax.optim import LeafGroup, model_param_groups


def _stepper(cfg, groups, batch):
    """A function running one jitted train step (compiled and warmed up on creation)."""
    programs = build_programs(cfg, devices=jax.devices()[:1], groups=groups)  # as `zaya train` runs it
    box = [programs.init_state()]

    def run() -> None:
        box[0], metrics = programs.train_step(*programs.step_arguments(box[0], batch))
        jax.block_until_ready(metrics)

    run()  # compile + warm-up
    run()
    return run


def _interleaved_best(runs, repeats: int) -> list[float]:
    """Best time of each function, alternating them so that machine noise hits both alike."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192], help="tokens per step")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    cfg = zaya_jax.load_config(args.config)
    muon = model_param_groups(cfg.model, cfg.optim.router_group)
    adamw = jax.tree.map(
        lambda g: LeafGroup("adamw", None, g.decay), muon, is_leaf=lambda x: isinstance(x, LeafGroup)
    )
    rows = make_row_iterator(cfg.data, load_tokenizer(cfg.data.tokenizer), seq_len=cfg.train.seq_len, seed=0)
    results = []
    for tokens in args.tokens:
        batch_size = max(1, tokens // cfg.train.seq_len)
        batch = {k: jnp.asarray(v) for k, v in next_batch(rows, batch_size).items()}
        t_muon, t_adamw = _interleaved_best(
            [_stepper(cfg, muon, batch), _stepper(cfg, adamw, batch)], args.repeats
        )
        results.append(
            {
                "tokens_per_step": batch_size * cfg.train.seq_len,
                "muon_step_s": round(t_muon, 4),
                "adamw_step_s": round(t_adamw, 4),
                "muon_over_adamw": round(t_muon / t_adamw, 3),
            }
        )
    print(json.dumps({"config": args.config, "device": str(jax.devices()[0]), "results": results}, indent=2))


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
