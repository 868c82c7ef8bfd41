"""Forward-pass throughput of zaya-jax against HF transformers ``ZayaForCausalLM`` (PyTorch, CPU).

Same shapes (the ``tiny`` preset's model), same batch, float32, both measured in this run:
prints tokens/s for every zaya-jax MoE path and the ratio to HF. Usage:

    python bench/forward_vs_hf.py [--batch 8] [--seq 128] [--repeats 10] [--config tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

import zaya_jax
from zaya_jax.interop.hf import hf_to_variables, model_to_hf_config
from zaya_jax.model import Zaya


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up (compilation for JAX)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    cfg = zaya_jax.load_config(args.config).model
    hf = transformers.ZayaForCausalLM(transformers.ZayaConfig(**model_to_hf_config(cfg))).eval()
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    variables = jax.tree.map(jnp.asarray, hf_to_variables(state, cfg))
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(args.batch, args.seq))
    tokens = args.batch * args.seq

    torch_ids = torch.as_tensor(ids)

    def run_hf():
        with torch.no_grad():
            return hf(input_ids=torch_ids, use_cache=False).logits

    results = {"hf_transformers": tokens / _best_time(run_hf, args.repeats)}
    for impl in ("sorted", "capacity", "dense"):
        apply = jax.jit(Zaya(dataclasses.replace(cfg, moe_impl=impl)).apply)
        jax_ids = jnp.asarray(ids)
        results[f"zaya_jax_{impl}"] = tokens / _best_time(
            lambda apply=apply, jax_ids=jax_ids: jax.block_until_ready(apply(variables, jax_ids)),
            args.repeats,
        )

    report = {
        "machine": f"{platform.processor() or platform.machine()}, {jax.devices()[0].platform}, {torch.get_num_threads()} torch threads",
        "shape": {"config": args.config, "batch": args.batch, "seq": args.seq},
        "tokens_per_s": {k: round(v) for k, v in results.items()},
        "ratio_vs_hf": {k: round(v / results["hf_transformers"], 2) for k, v in results.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
