"""GRPO on a chat task it was not tuned on: an HF BPE tokenizer with a ChatML template (the end of a
turn, ``<|im_end|>``, is not the EOS, ``</s>``) and a partial-credit reward, the shape of issue 40's
held-out task.

The task is :func:`zaya_jax.data.tasks.sort_chats` ("sort: qbxa" -> "abqx", 3-7 random letters) with
:func:`~zaya_jax.data.tasks.sort_reward` (the fraction of characters in place, up to the end of turn).

1. A byte-level BPE tokenizer (320 ids: 5 specials, the 256-byte alphabet, merges) trained on the
   rendered conversations, ChatML as its ``chat_template`` (no generation blocks: the assistant
   spans come from rendered prefixes, as for most published templates).
2. SFT (``configs/sft.yaml`` on ``tiny`` with that tokenizer, ``--sft-steps`` steps on 4,000
   conversations): the starting point, its held-out exact match and reward measured.
3. GRPO from it (``configs/grpo-chat.yaml`` and the variant's overrides; without ``--variant``, the
   ``grpo`` preset's settings against ``grpo-chat``'s) on 2,000 other prompts,
   the held-out mean greedy reward on 128 prompts of the prompt file (none in the SFT data) at step
   0 and every ``--eval-every`` steps, one run per variant: ``--variant NAME=OVERRIDE,OVERRIDE``
   (config overrides; ``legacy`` in the list: rollouts as before the fix of issue 40, stopping at
   the EOS only and showing the reward the text with special tokens removed; the held-out
   evaluation is the same for every variant).

Everything runs in child processes (``zaya train``), so ``taskset -c 1 python bench/grpo_chat.py``
keeps to one core.

    python bench/grpo_chat.py [--workdir DIR] [--sft-steps 120] [--grpo-steps 100] [--variant ...]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "</s>", "<s>", "<|im_start|>", "<|im_end|>"]  # ids 0-4: tiny's pad/eos/bos are 0/1/2
VOCAB = 320
# The tasks (--task): the records, the reward (rl.reward), and what it measures.
TASKS = {
    "sort": ("sort_chats", "zaya_jax.data.tasks:sort_reward", "partial credit: the letters in place"),
    "reverse": ("reverse_chats", "zaya_jax.rewards:exact_match", "binary: the reversed word exactly"),
    "add": ("add_chats", "zaya_jax.rewards:math_answer", "binary: the sum, checked by math-verify"),
}
# Without --variant: the grpo preset's settings (tuned on the reverse task) against grpo-chat's.
DEFAULT_VARIANTS = {
    "the grpo preset's settings": "rl.temperature=1.0,optim.muon_lr=0.002,optim.adam_lr=2e-4",
    "configs/grpo-chat.yaml": "",
}


def build_tokenizer(directory: Path, records: list[dict]) -> Path:
    """A byte-level BPE tokenizer.json trained on ``records`` rendered with ChatML, and a
    tokenizer_config.json naming its special tokens and the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    texts = [
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in r["messages"])
        for r in records
    ]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "chat_template": CHATML}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def _train(work: Path, args: list[str], legacy: bool = False) -> float:
    started = time.perf_counter()
    child = [sys.executable, str(Path(__file__).resolve()), "--child", *(["--legacy"] if legacy else [])]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([*child, "train", *args, "--no-progress"], cwd=work, check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - started


def _child(argv: list[str]) -> None:
    """``zaya ARGV`` in this process, under the allocator the ``zaya`` command runs with (mimalloc,
    :mod:`zaya_jax.allocator`: without it a GRPO step takes about twice as long); with ``--legacy``
    first, rollouts as before issue 40's fix."""
    from zaya_jax.allocator import reexec_with_allocator

    reexec_with_allocator()  # before JAX is imported: the same command, re-executed once
    if argv and argv[0] == "--legacy":
        argv = argv[1:]
        from zaya_jax.objectives import rollouts

        def old_stops(cfg, tokenizer, chat=None):
            return (*cfg.model.stop_token_ids, tokenizer.eos_id)

        def old_texts(tokenizer, rows):
            return [tokenizer.decode([t for t in row if t != tokenizer.eos_id]) for row in rows]

        rollouts.rollout_stop_ids, rollouts.completion_texts = old_stops, old_texts
    from zaya_jax.cli import main

    sys.exit(main(argv))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _held_out(step_dir: Path, cfg_overrides: list[str], work: Path, reward: str) -> tuple[float, float]:
    """(mean reward, exact match) of a saved model's greedy completions of the held-out prompts."""
    import zaya_jax
    from zaya_jax.config import load_config, to_dict
    from zaya_jax.data import load_tokenizer
    from zaya_jax.objectives.rewards import PromptSet, held_out_reward
    from zaya_jax.rewards.calls import load_reward

    score = load_reward(reward)

    cwd = os.getcwd()
    os.chdir(work)
    try:
        lm = zaya_jax.load(step_dir)
        cfg = load_config(str(ROOT / "configs" / "grpo-chat.yaml"), cfg_overrides, model=to_dict(lm.config))
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        prompts = PromptSet(cfg).held_out
        mean = held_out_reward(cfg, lm.variables, tokenizer, prompts, score)
        exact = held_out_reward(cfg, lm.variables, tokenizer, prompts, lambda r, t: float(score(r, t) == 1))
    finally:
        os.chdir(cwd)
    return mean, exact


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--sft-steps", type=int, default=120)
    parser.add_argument("--grpo-steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--task", choices=sorted(TASKS), default="sort")
    parser.add_argument("--seeds", default="0", help="train.seed of each GRPO run, comma-separated")
    parser.add_argument("--prompts", type=int, default=2000, help="GRPO prompts in the file (10%% held out)")
    parser.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts eval_reward scores")
    parser.add_argument(
        "--variant", action="append", default=[], help="NAME=OVERRIDE,OVERRIDE (or legacy); NAME without '='"
    )
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="zaya-grpo-chat-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    from zaya_jax.data import tasks

    chats, reward, shape = TASKS[args.task]
    chats = getattr(tasks, chats)
    print(f"# {platform.node()} ({len(os.sched_getaffinity(0))} cores usable); {work}; task {args.task} "
          f"({shape}, rl.reward={reward})", flush=True)  # fmt: skip
    sft_records = chats(4000, seed=0)
    if not (work / "tok" / "tokenizer.json").exists():
        build_tokenizer(work / "tok", sft_records)
        tasks.write_jsonl(work / "chat.jsonl", sft_records)
        seen = {r["messages"][0]["content"] for r in sft_records}
        fresh = [r for r in chats(2 * args.prompts, seed=[0, 1]) if r["messages"][0]["content"] not in seen]
        prompts = list({r["messages"][0]["content"]: r for r in fresh}.values())[: args.prompts]  # distinct
        tasks.write_jsonl(work / "prompts.jsonl", prompts)
    data = [f"data.tokenizer={work / 'tok' / 'tokenizer.json'}", f"model.vocab_size={VOCAB}"]
    sft = work / "runs" / f"sft{args.sft_steps}"
    if not (sft / "summary.json").exists():
        seconds = _train(work, ["sft", f"run.name={sft.name}", f"train.steps={args.sft_steps}", "eval.every=100000",
                                "data.sources=[{name: chat, kind: chat, path: chat.jsonl}]", *data])  # fmt: skip
        print(f"SFT: {args.sft_steps} steps in {seconds:.0f} s", flush=True)
    start = sft / "checkpoints" / str(args.sft_steps)
    grpo = [
        f"data.tokenizer={work / 'tok' / 'tokenizer.json'}",
        "rl.prompts=prompts.jsonl",
        f"rl.eval_prompts={args.eval_prompts}",
        f"rl.reward={reward}",
    ]
    base, exact = _held_out(start, grpo, work, reward)
    print(
        f"start (SFT step {args.sft_steps}): held-out reward {base:.3f}, exact match {exact:.1%}", flush=True
    )
    variants = dict(v.split("=", 1) for v in args.variant) if args.variant else DEFAULT_VARIANTS
    print("| variant | seed | time | s/step | held-out reward, step 0 → every " f"{args.eval_every} | gain | "
          "train reward first/last 10 | zero-advantage rows | completion length | clip fraction |\n"
          "|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for seed in (int(s) for s in args.seeds.split(",")):  # the variants interleaved: seed by seed
        for name, spec in variants.items():
            _variant(work, args, start, grpo, name, spec, seed)


def _variant(work: Path, args, start: Path, grpo: list[str], name: str, spec: str, seed: int) -> None:
    """One GRPO run of a variant from ``start`` and its table row."""
    overrides = [o for o in spec.split(",") if o and o != "legacy"]
    run = f"grpo-{hashlib.sha256(spec.encode()).hexdigest()[:8]}-s{seed}-sft{start.name}-{args.grpo_steps}"
    if not (work / "runs" / run / "summary.json").exists():
        seconds = _train(work, [str(ROOT / "configs" / "grpo-chat.yaml"), "--init-from", str(start),
                                f"run.name={run}", f"train.steps={args.grpo_steps}", f"eval.every={args.eval_every}",
                                "log.every=1", f"train.seed={seed}", *grpo, *overrides],
                         legacy="legacy" in spec.split(","))  # fmt: skip
    else:
        seconds = float("nan")
    records = [r for r in _metrics(work / "runs" / run)]
    curve = [r["eval_reward"] for r in records if "eval_reward" in r]  # step 0 (eval.at_start) first
    steps = [r for r in records if "reward" in r]

    def mean(key: str, rows: list[dict]) -> float:
        return float(np.mean([r[key] for r in rows if key in r]))

    # a step's wall time (sampling, scoring and training; evaluations left out): its tokens over
    # its tokens/s (log.every=1); step 1 (compiling) left out
    seconds_per_step = float(np.mean([(b["tokens_seen"] - a["tokens_seen"]) / b["tokens_per_s"]
                                      for a, b in itertools.pairwise(steps)]))  # fmt: skip

    print(
        f"| {name} | {seed} | {seconds:.0f} s | {seconds_per_step:.2f} | {' → '.join(f'{v:.3f}' for v in curve)} | {curve[-1] - curve[0]:+.3f} | "
        f"{mean('reward', steps[:10]):.3f} / {mean('reward', steps[-10:]):.3f} | "
        f"{mean('zero_advantage', steps):.0%} | {mean('completion_length', steps[:10]):.1f} → "
        f"{mean('completion_length', steps[-10:]):.1f} | {mean('clip_fraction', steps):.3f} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
