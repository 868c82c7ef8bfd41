"""Training throughput of zaya-jax against HF transformers ``ZayaForCausalLM`` (PyTorch) and against
a dense model of equal active size, all measured in this run.

One training step = forward, backward, gradient clipping and the optimizer update, on the same
batch of random token ids (next-token loss), float32:

* ``hf_adamw``: HF ``ZayaForCausalLM`` (built from the preset's model config, the same weights),
  ``torch.optim.AdamW`` (fused where PyTorch offers it) and ``clip_grad_norm_``;
* ``zaya_muon``: zaya-jax's jitted train step as ``zaya train`` runs it (Muon+AdamW, balancing
  controller), per MoE path;
* ``zaya_adamw``: the same step with every leaf on AdamW (the optimizer HF is run with);
* ``dense_muon``: zaya-jax with one expert instead of E (every token through the same MLP of the
  same width): the dense model whose per-token active size equals the MoE's.

Prints tokens/s, model-FLOPs utilisation (against a float32 matmul peak measured in the same
process on CPU, the datasheet peak on a GPU) and every ratio against ``hf_adamw``. On a GPU both
frameworks run on it (PyTorch through CUDA or ROCm). Usage:

    python bench/train_vs_hf.py [--config tiny] [--batch 16] [--seq 128] [--repeats 5] [--set key=value ...]
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
from zaya_jax.optim import LeafGroup, build_optimizer, model_param_groups, set_lr_scale
from zaya_jax.train.flops import flops_per_token, measured_cpu_peak, peak_flops
from zaya_jax.train.step import init_train_state, make_train_step


def _interleaved_best(runs: dict, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Best time of each function, run in turn (round-robin) so machine noise hits all alike.
    Warm-up calls first: compilation (JAX), allocator and thread pools (both)."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _batch(ids: np.ndarray) -> dict[str, jax.Array]:
    inputs, targets = ids[:, :-1], ids[:, 1:]
    ones = np.ones_like(inputs)
    return {
        "inputs": jnp.asarray(inputs, jnp.int32),
        "targets": jnp.asarray(targets, jnp.int32),
        "segment_ids": jnp.asarray(ones, jnp.int32),
        "positions": jnp.asarray(np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape), jnp.int32),
        "loss_mask": jnp.asarray(ones, jnp.float32),
    }


def zaya_stepper(cfg, variables, batch, *, adamw_only: bool):
    groups = model_param_groups(cfg.model, cfg.optim.router_group)
    if adamw_only:
        groups = jax.tree.map(
            lambda g: LeafGroup("adamw", None, g.decay), groups, is_leaf=lambda x: isinstance(x, LeafGroup)
        )
    tx = build_optimizer(cfg.optim, groups, 1000)
    step = jax.jit(make_train_step(cfg, tx, set_lr_scale), donate_argnums=0)
    box = [init_train_state(jax.tree.map(jnp.copy, variables), tx)]  # the step donates its state
    scale = jnp.float32(1.0)

    def run():
        box[0], metrics = step(box[0], batch, scale)
        jax.block_until_ready(metrics["loss"])

    return run


def hf_stepper(hf_cfg: dict, ids: np.ndarray, cfg, device: str):
    torch.manual_seed(0)
    model = transformers.ZayaForCausalLM(transformers.ZayaConfig(**hf_cfg)).train().to(device)
    try:
        opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.optim.adam_lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True
        )
    except (RuntimeError, TypeError):  # no fused CPU AdamW in this PyTorch
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.adam_lr, betas=(0.9, 0.95), weight_decay=0.1)
    torch_ids = torch.as_tensor(ids, device=device)

    def run():
        loss = model(input_ids=torch_ids, labels=torch_ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    return run, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128, help="tokens per row that enter the loss")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=["sorted", "capacity"], help="zaya-jax MoE paths")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.dtype=float32")
    args = parser.parse_args()

    cfg = zaya_jax.load_config(args.config, overrides=[f"train.batch_size={args.batch}", *args.set])
    if cfg.model.dtype != "float32":
        parser.error("HF runs in float32 here; compare like with like: --set model.dtype=float32")
    ids = np.random.default_rng(0).integers(3, cfg.model.vocab_size, size=(args.batch, args.seq + 1))
    tokens = args.batch * args.seq
    on_gpu = jax.default_backend() == "gpu"
    # Same accelerator for both: the GPU when JAX runs on one and PyTorch sees it (CUDA or ROCm).
    device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    # MFU against one GPU's datasheet peak in the model's dtype, or this CPU's measured peak.
    peak = peak_flops(cfg.model.dtype)[0] / jax.device_count() if on_gpu else measured_cpu_peak()

    # HF consumes seq + 1 ids and scores seq of them; zaya-jax gets the same rows split into
    # inputs and targets, so both see `tokens` loss positions (HF runs one extra position).
    hf_run, hf_state = hf_stepper(model_to_hf_config(cfg.model), ids, cfg, device)
    variables = jax.tree.map(jnp.asarray, hf_to_variables(hf_state, cfg.model))
    batch = _batch(ids)
    runs = {"hf_adamw": hf_run}
    for impl in args.impls:
        impl_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_impl=impl))
        runs[f"zaya_muon_{impl}"] = zaya_stepper(impl_cfg, variables, batch, adamw_only=False)
        runs[f"zaya_adamw_{impl}"] = zaya_stepper(impl_cfg, variables, batch, adamw_only=True)
    dense_model = dataclasses.replace(cfg.model, num_experts=1)
    dense_cfg = dataclasses.replace(cfg, model=dense_model)
    dense_vars = zaya_jax.model.init_variables(dense_model, 0)
    runs["dense_muon"] = zaya_stepper(dense_cfg, dense_vars, batch, adamw_only=False)
    times = _interleaved_best(runs, args.repeats)

    moe_flops = flops_per_token(cfg.model, args.seq)
    dense_flops = flops_per_token(dense_model, args.seq)
    report = {
        "machine": f"{platform.processor() or platform.machine()}, jax on {jax.devices()[0].device_kind}, "
        f"torch on {device} ({torch.get_num_threads()} threads)",
        "peak_source": "datasheet" if on_gpu else "measured float32 matmul",
        "shape": {"config": args.config, "batch": args.batch, "seq": args.seq, "dtype": cfg.model.dtype},
        "peak_gflops": round(peak / 1e9, 1),
        "step_s": {k: round(v, 4) for k, v in times.items()},
        "tokens_per_s": {k: round(tokens / v) for k, v in times.items()},
        "mfu": {
            k: round(tokens * (dense_flops if k.startswith("dense") else moe_flops) / v / peak, 4)
            for k, v in times.items()
        },
        "ratio_vs_hf": {k: round(times["hf_adamw"] / v, 2) for k, v in times.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
