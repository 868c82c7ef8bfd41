"""TRL's ``GRPOTrainer`` on the task and from the start ``bench/grpo_chat.py`` trains zaya-jax's
GRPO from: the same SFT checkpoint (its HF export, loaded by transformers), the same training
prompts (the prompt file's training split, as ``rl.prompts`` takes it), reward function, group size
(8 completions of 8 prompts per step, one step per generation), temperature and number of steps,
each learning rate of ``--lrs`` (AdamW, TRL's default ``dapo`` loss, no KL). The held-out reward is
measured by zaya-jax's evaluator on the same held-out prompts (greedy, the model saved every
``--eval-every`` steps and loaded back through ``zaya_jax.load``), so both stacks' curves are read
with one ruler.

Run ``bench/grpo_chat.py --workdir DIR --task TASK`` first (it builds the tokenizer, the prompt file
and the SFT start in DIR), then:

    python bench/grpo_trl.py --workdir DIR --task TASK [--sft-steps 120] [--lrs 1e-5,3e-5,1e-4] [--seeds 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from grpo_chat import TASKS  # noqa: E402  (the tasks and their rewards: one table for both benches)


def _export(work: Path, start: Path) -> Path:
    """The SFT checkpoint as an HF directory with the task's tokenizer, its chat template and a
    generation config that stops at the end of turn (as zaya's rollouts do)."""
    hf = work / f"hf-{start.parent.parent.name}"
    if not (hf / "config.json").exists():
        subprocess.run([sys.executable, "-m", "zaya_jax.cli", "convert", "zaya-to-hf", str(start), str(hf)],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(work / "tok" / name, hf / name)
        (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4], "pad_token_id": 0}))
    return hf


class _HeldOut:
    """zaya-jax's held-out evaluation of an HF directory: the mean greedy reward of the prompt
    file's held-out prompts, as ``eval_reward`` of a ``grpo`` run scores them."""

    def __init__(self, work: Path, reward: str, eval_prompts: int):
        import zaya_jax
        from zaya_jax.config import load_config
        from zaya_jax.data import load_tokenizer
        from zaya_jax.objectives.rewards import PromptSet
        from zaya_jax.rewards.calls import load_reward

        os.chdir(work)
        overrides = [f"data.tokenizer={work / 'tok' / 'tokenizer.json'}", "rl.prompts=prompts.jsonl",
                     f"rl.reward={reward}", f"rl.eval_prompts={eval_prompts}"]  # fmt: skip
        self.cfg_path, self.overrides = str(ROOT / "configs" / "grpo-chat.yaml"), overrides
        self.load, self.load_config = zaya_jax.load, load_config
        cfg = load_config(self.cfg_path, overrides)
        self.prompts = PromptSet(cfg)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.reward = load_reward(reward)

    def train_records(self) -> list[dict]:
        return list(self.prompts._records)

    def __call__(self, directory: Path) -> float:
        from zaya_jax.config import to_dict
        from zaya_jax.objectives.rewards import held_out_reward

        lm = self.load(directory)
        cfg = self.load_config(self.cfg_path, self.overrides, model=to_dict(lm.config))
        return held_out_reward(cfg, lm.variables, self.tokenizer, self.prompts.held_out, self.reward)


def _run(hf: Path, work: Path, evaluate: _HeldOut, reward: str, lr: float, seed: int, args) -> list[float]:
    import datasets
    import torch
    import transformers
    import trl

    from zaya_jax.rewards import prompt_messages
    from zaya_jax.rewards.calls import load_reward

    torch.manual_seed(seed)
    score = load_reward(reward)
    records = evaluate.train_records()
    data = datasets.Dataset.from_dict({
        "prompt": [prompt_messages(r) for r in records],
        "record": [json.dumps(r) for r in records],
    })  # fmt: skip

    def rewards(completions, record, **_):
        return [
            float(score(json.loads(r), c[0]["content"])) for c, r in zip(completions, record, strict=True)
        ]

    out = work / "trl" / f"lr{lr:g}-s{seed}"
    config = trl.GRPOConfig(
        output_dir=str(out), learning_rate=lr, per_device_train_batch_size=64, num_generations=8,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, beta=0.0,
        max_steps=args.steps, warmup_steps=5, lr_scheduler_type="constant_with_warmup", logging_steps=10,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=seed, optim="adamw_torch",
        **({} if args.router_aux_loss_coef is None else {"router_aux_loss_coef": args.router_aux_loss_coef}),
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    curve = [evaluate(hf)]

    class Evaluate(transformers.TrainerCallback):
        def on_step_end(self, _args, state, control, model=None, **kwargs):
            if state.global_step % args.eval_every == 0:
                saved = out / f"step{state.global_step}"
                model.save_pretrained(saved)
                for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                    shutil.copy(hf / name, saved / name)
                curve.append(evaluate(saved))
                shutil.rmtree(saved)

    trainer = trl.GRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Evaluate()])  # fmt: skip
    trainer.train()
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", required=True, help="bench/grpo_chat.py's --workdir for the task")
    parser.add_argument("--task", choices=sorted(TASKS), default="sort")
    parser.add_argument("--sft-steps", type=int, default=120)
    parser.add_argument("--lrs", default="1e-5,3e-5,1e-4")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--eval-prompts", type=int, default=128, help="as bench/grpo_chat.py's")
    parser.add_argument(
        "--router-aux-loss-coef", type=float, default=None,
        help="TRL's router auxiliary loss weight (default: TRL's, from the model config; zaya adds none)",
    )  # fmt: skip
    args = parser.parse_args()
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    work = Path(args.workdir).resolve()
    reward = TASKS[args.task][1]
    start = work / "runs" / f"sft{args.sft_steps}" / "checkpoints" / str(args.sft_steps)
    hf = _export(work, start)
    evaluate = _HeldOut(work, reward, args.eval_prompts)
    print(
        f"# TRL {__import__('trl').__version__} GRPOTrainer, task {args.task}, from {start}, T={args.temperature}"
    )
    print("| learning rate | seed | time | held-out reward, step 0 → every "
          f"{args.eval_every} | gain |\n|---|---|---|---|---|")  # fmt: skip
    for lr in (float(x) for x in args.lrs.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            began = time.perf_counter()
            curve = _run(hf, work, evaluate, reward, lr, seed, args)
            print(f"| {lr:g} | {seed} | {time.perf_counter() - began:.0f} s | "
                  f"{' → '.join(f'{v:.3f}' for v in curve)} | {curve[-1] - curve[0]:+.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
