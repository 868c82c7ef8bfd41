"""Post-training ``tiny`` on the built-in reverse task, SFT -> DPO -> GRPO, with the commands the
post-training guide (docs/post-training.md) gives, and the curves each stage is judged by.

1. SFT (``zaya train sft``, 300 steps of 16 x 128 on 4,000 conversations): greedy exact match on
   held-out prompts (words of another seed, none of them in the training set) at every saved step.
2. DPO from SFT step ``--start`` (``zaya train dpo --init-from``): held-out pair accuracy and loss.
3. GRPO from SFT step ``--start`` (partly trained): the held-out mean greedy reward (exact match)
   every 10 steps, on-policy (one step per rollout, routes replayed), and off-policy (four steps per
   rollout) with and without router replay, with how often the trainer's unforced router disagreed
   with the sampler's (``route_flips``: the fraction of (token, layer) replay overrides).

Every reward is the same function, :func:`zaya_jax.data.tasks.reverse_reward`, on the same
held-out prompts; the starting point's reward is measured, not assumed. Times are wall-clock on
the machine named with its measured float32 matmul peak.

    python bench/post_training.py [--workdir DIR] [--start 200] [--grpo-steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ZAYA = [sys.executable, "-m", "zaya_jax.cli"]


def _run(args: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run([*ZAYA, *args, "--no-progress"] if args[0] == "train" else [*ZAYA, *args], cwd=cwd,
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - started


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _held_out_prompts(n: int = 256) -> list[dict]:
    from zaya_jax.data.tasks import reverse_chats

    seen = {r["messages"][0]["content"] for r in reverse_chats(4000, seed=0)}
    return [r for r in reverse_chats(2 * n, seed=[0, 1]) if r["messages"][0]["content"] not in seen][:n]


def _exact_match(step_dir: Path, prompts: list[dict]) -> float:
    """Greedy exact match of a saved model on ``prompts`` (the GRPO preset's prompt shape)."""
    import zaya_jax
    from zaya_jax.config import load_config
    from zaya_jax.data import load_tokenizer
    from zaya_jax.data.tasks import reverse_reward
    from zaya_jax.objectives.rewards import held_out_reward

    lm = zaya_jax.load(step_dir)
    cfg = load_config("grpo")
    return held_out_reward(cfg, lm.variables, load_tokenizer("byte"), prompts, reverse_reward)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--start", type=int, default=200, help="the SFT step DPO and GRPO start from")
    parser.add_argument("--grpo-steps", type=int, default=60)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="zaya-post-"))
    work.mkdir(parents=True, exist_ok=True)
    from zaya_jax.train.flops import measured_cpu_peak

    peak = measured_cpu_peak()
    print(
        f"# {platform.node()} ({os.cpu_count()} cores), float32 matmul peak {peak / 1e9:.0f} GFLOP/s; {work}"
    )
    prompts = _held_out_prompts()
    for command in (["data", "example-chat", "chat.jsonl"], ["data", "example-preference", "pairs.jsonl"]):
        if not (work / command[-1]).exists():
            _run(command, work)

    sft = work / "runs" / "sft"
    seconds = _run(["train", "sft", "checkpoint.every_steps=50", "checkpoint.keep=10"], work)
    steps = sorted(int(p.name) for p in (sft / "checkpoints").iterdir() if p.name.isdigit())
    curve = {0: 0.0} | {s: _exact_match(sft / "checkpoints" / str(s), prompts) for s in steps}
    print(f"\n## SFT ({seconds:.0f} s): greedy exact match on {len(prompts)} held-out prompts")
    print("| step | " + " | ".join(map(str, curve)) + " |")
    print("|---" * (len(curve) + 1) + "|")
    print("| exact match | " + " | ".join(f"{v:.1%}" for v in curve.values()) + " |")

    start = sft / "checkpoints" / str(args.start)
    dpo = ["train", "dpo", "--init-from", str(start), "train.steps=100", "eval.every=20", "log.every=1"]
    seconds = _run(dpo, work)
    evals = [r for r in _metrics(work / "runs" / "dpo") if "eval_pair_accuracy" in r]
    first = next(r for r in _metrics(work / "runs" / "dpo") if "loss" in r)
    print(
        f"\n## DPO from SFT step {args.start} ({seconds:.0f} s), step-1 loss {first['loss']:.6f} (ln 2 = 0.693147)"
    )
    print("| step | held-out pair accuracy | held-out loss | reward margin |\n|---|---|---|---|")
    for r in evals:
        print(
            f"| {r['step']} | {r['eval_pair_accuracy']:.1%} | {r['eval_loss']:.4f} | {r['eval_reward_margin']:.3f} |"
        )

    from zaya_jax.config import load_config
    from zaya_jax.objectives.rewards import PromptSet

    rl_prompts = PromptSet(load_config("grpo")).held_out  # the prompts eval_reward scores
    base = _exact_match(start, rl_prompts)
    variants = {
        "on-policy, replay": ["rl.steps_per_rollout=1", "rl.replay_routes=true"],
        "4 steps/rollout, replay": ["rl.steps_per_rollout=4", "rl.replay_routes=true"],
        "4 steps/rollout, no replay": ["rl.steps_per_rollout=4", "rl.replay_routes=false"],
    }
    rows = []
    for i, (name, overrides) in enumerate(variants.items()):
        run = f"grpo{i}"
        seconds = _run(
            ["train", "grpo", "--init-from", str(start), f"run.name={run}", f"train.steps={args.grpo_steps}",
             "eval.every=10", *overrides], work,
        )  # fmt: skip
        records = _metrics(work / "runs" / run)
        rewards = [r["eval_reward"] for r in records if "eval_reward" in r]
        flips = [r["route_flips"] for r in records if "route_flips" in r]
        rows.append((name, seconds, rewards, float(np.mean(flips)), float(np.max(flips))))
    print(
        f"\n## GRPO from SFT step {args.start}: held-out mean reward (greedy exact match) on "
        f"{len(rl_prompts)} prompts at step 0 and every 10 steps"
    )
    print("| variant | time | held-out mean reward | route_flips mean / max |\n|---|---|---|---|")
    for name, seconds, rewards, mean_flips, max_flips in rows:
        curve = " → ".join(f"{v:.3f}" for v in [base, *rewards])
        print(f"| {name} | {seconds:.0f} s | {curve} | {mean_flips:.2%} / {max_flips:.2%} |")


if __name__ == "__main__":
    main()
