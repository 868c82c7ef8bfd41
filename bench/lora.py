"""LoRA against full fine-tuning on ``tiny``'s built-in reverse task, from the same base, with the
LoRA guide's commands (docs/lora.md): the SFT curves (greedy exact match on held-out prompts at every saved step),
DPO's held-out pair accuracy with adapters, and, measured side by side in this process, the train
step's time and the optimizer state's size with and without adapters.

The base is an SFT run of ``--base-steps`` steps (38% exact match at 200); full fine-tuning
(``zaya train sft``, Muon + AdamW, ``--steps`` steps) and LoRA (``zaya train lora-sft``: rank 16 on
the experts and CCA's projections, AdamW only, ``--lora-steps`` steps) then continue it on the same
data; DPO with adapters (rank 16, AdamW 3e-3) starts from the same base. Step times are the best of ``--rounds`` rounds of each compiled step, the variants
interleaved; the machine is named with its measured float32 matmul peak.

    python bench/lora.py [--workdir DIR] [--base-steps 200] [--steps 200] [--lora-steps 600] [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location("post_training", Path(__file__).with_name("post_training.py"))
post = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(post)


def _curve(run: Path, prompts: list[dict]) -> dict[int, float]:
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    return {s: post._exact_match(run / "checkpoints" / str(s), prompts) for s in steps}


def _step_times(base: Path, rounds: int) -> dict[str, float]:
    """Best seconds of one compiled train step (16 x 128) per variant, rounds interleaved, and
    the optimizer state's bytes."""
    import jax

    import zaya_jax
    from zaya_jax.config import load_config
    from zaya_jax.objectives import build_programs
    from zaya_jax.parallel import put_batch
    from zaya_jax.train.init import source_model_config

    model = zaya_jax.config.to_dict(source_model_config(base))
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 259, (16, 129)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((16, 128), np.int32),
             "positions": np.tile(np.arange(128, dtype=np.int32), (16, 1)), "loss_mask": np.ones((16, 128), np.float32)}  # fmt: skip
    variants = {}
    for name, preset in (("full", "sft"), ("lora", "lora-sft")):
        cfg = load_config(preset, [f"train.init_from={base}"], model=model)
        programs = build_programs(cfg)
        state = programs.init_state()
        step = programs.lower_train_step().compile()
        args = programs.step_arguments(state, put_batch(batch, programs.layout.batch))
        opt = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
        variants[name] = {"step": step, "args": args, "opt_bytes": opt, "best": float("inf")}
        if name == "lora":  # a reference forward with the adapters switched off (what DPO could run per step)
            from zaya_jax.model.lowrank import switched_off

            forward = programs.sequence_logps_step
            copied = jax.tree.map(lambda x: x.copy(), (switched_off(state.params), state.balancing))
            reference = (*copied, args[1])  # copies: the train step donates the state's arrays
            variants["reference"] = {"forward": forward, "args": reference, "best": float("inf")}
    for _ in range(rounds):
        for v in variants.values():
            if "forward" in v:
                jax.block_until_ready(v["forward"](*v["args"]))
                started = time.perf_counter()
                jax.block_until_ready(v["forward"](*v["args"]))
                v["best"] = min(v["best"], time.perf_counter() - started)
                continue
            state, metrics = v["step"](*v["args"])
            jax.block_until_ready(metrics["loss"])
            v["args"] = (state, *v["args"][1:])
            started = time.perf_counter()
            state, metrics = v["step"](*v["args"])
            jax.block_until_ready(metrics["loss"])
            v["best"] = min(v["best"], time.perf_counter() - started)
            v["args"] = (state, *v["args"][1:])
    return {
        f"{k}_{m}": v.get(key, 0)
        for k, v in variants.items()
        for m, key in (("s", "best"), ("opt_bytes", "opt_bytes"))
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--base-steps", type=int, default=200)
    parser.add_argument("--steps", type=int, default=200, help="full fine-tuning's steps")
    parser.add_argument("--lora-steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lora", nargs="*", default=[], help="extra overrides of the LoRA run")
    parser.add_argument("--times-only", action="store_true", help="only the step times (the base must exist)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="zaya-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    from zaya_jax.train.flops import measured_cpu_peak

    print(
        f"# {platform.node()} ({os.cpu_count()} cores), float32 matmul peak {measured_cpu_peak() / 1e9:.0f} GFLOP/s; {work}"
    )
    for command in (["data", "example-chat", "chat.jsonl"], ["data", "example-preference", "pairs.jsonl"]):
        if not (work / command[-1]).exists():
            post._run(command, work)
    base = work / "runs" / f"base{args.base_steps}"
    if not (base / "summary.json").exists():
        post._run(["train", "sft", f"run.name={base.name}", f"train.steps={args.base_steps}"], work)
    if args.times_only:
        return _print_times(_step_times(base, args.rounds))
    prompts = post._held_out_prompts()
    start = post._exact_match(base, prompts)
    every = [
        "checkpoint.every_steps=50",
        "checkpoint.keep=10",
        f"train.steps={args.steps}",
        "--init-from",
        str(base),
    ]
    rows = {}
    for name, preset, extra in (("full fine-tuning", "sft", []), ("LoRA rank 16", "lora-sft", args.lora)):
        run = f"{preset}-from-base"
        seconds = post._run(["train", preset, f"run.name={run}", *every, *extra], work)
        rows[name] = (seconds, _curve(work / "runs" / run, prompts))
    steps = sorted(next(iter(rows.values()))[1])
    print(
        f"\n## SFT from the base (SFT step {args.base_steps}, {start:.1%}): greedy exact match on {len(prompts)} held-out prompts"
    )
    print("| variant | time | " + " | ".join(str(s) for s in [0, *steps]) + " |")
    print("|---|---|" + "---|" * (len(steps) + 1))
    for name, (seconds, curve) in rows.items():
        print(
            f"| {name} | {seconds:.0f} s | {start:.1%} | "
            + " | ".join(f"{curve[s]:.1%}" for s in steps)
            + " |"
        )

    dpo = ["train", "dpo", "run.name=lora-dpo", "--init-from", str(base), "lora.rank=16", "lora.alpha=32",
           "optim.adam_lr=3e-3", "train.steps=100", "eval.every=20", "log.every=1"]  # fmt: skip
    seconds = post._run(dpo, work)
    evals = [r for r in post._metrics(work / "runs" / "lora-dpo") if "eval_pair_accuracy" in r]
    print(f"\n## LoRA DPO from the base ({seconds:.0f} s): held-out pairs")
    print("| step | pair accuracy | loss | reward margin |\n|---|---|---|---|")
    for r in evals:
        print(
            f"| {r['step']} | {r['eval_pair_accuracy']:.1%} | {r['eval_loss']:.4f} | {r['eval_reward_margin']:.3f} |"
        )

    _print_times(_step_times(base, args.rounds))


def _print_times(t: dict[str, float]) -> None:
    print("\n## One train step, 16 x 128, best of rounds (interleaved)")
    print("| variant | step | optimizer state |\n|---|---|---|")
    print(f"| full fine-tuning | {t['full_s'] * 1e3:.1f} ms | {t['full_opt_bytes'] / 1e6:.2f} MB |")
    print(f"| LoRA rank 16 | {t['lora_s'] * 1e3:.1f} ms ({t['lora_s'] / t['full_s']:.2f}x) | "
          f"{t['lora_opt_bytes'] / 1e6:.3f} MB ({t['lora_opt_bytes'] / t['full_opt_bytes']:.3f}x) |")  # fmt: skip
    print(f"| the base's forward (adapters off: a per-step DPO reference) | {t['reference_s'] * 1e3:.1f} ms "
          f"({t['reference_s'] / t['lora_s']:.2f}x the LoRA step) | |")  # fmt: skip


if __name__ == "__main__":
    main()
