"""Reasoning evaluation's sampled answers per second: ``zaya eval --task`` (every prompt's n samples
through the rollout engine at once, a prompt read once for its n samples:
:func:`zaya_jax.scoring.answers.score_answers`) against what a user had before it, one
``LanguageModel.generate`` call per sample (its cache capacity fixed, so every call runs one
compiled program). Both sample the same prompts (rendered with the chat template, stopping at the
end of turn) the same number of times with the same settings, and are checked by the same
checker; the variants alternate round by round, each timed after a warm-up round that compiles.

    python bench/grpo_chat.py --workdir DIR --task add --sft-steps 700   # its SFT start is the model
    python bench/reasoning_eval.py --model DIR/runs/sft700 --task add:64 --samples 8
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np


def _engine(lm, records, args) -> tuple[float, float]:
    from zaya_jax.eval.reasoning import evaluate_reasoning

    began = time.perf_counter()
    result = evaluate_reasoning(
        lm, records, check=args.check, samples=args.samples, ks=[1], temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, slots=args.slots,
    )  # fmt: skip
    return time.perf_counter() - began, result.metrics["pass@1"].value


def _one_at_a_time(lm, records, args) -> tuple[float, float]:
    from zaya_jax.config import Config
    from zaya_jax.data.chat import ChatEncoder, rollout_stop_ids, tokenizer_chat_template
    from zaya_jax.rewards import prompt_messages
    from zaya_jax.rewards.calls import load_reward

    tok, check = lm.tokenizer, load_reward(args.check)
    chat = ChatEncoder(tok, tokenizer_chat_template(tok))
    stops = rollout_stop_ids(Config(model=lm.config), tok, chat)
    began, correct = time.perf_counter(), []
    for record in records:
        ids = tok.encode(chat.prompt(prompt_messages(record))).tolist()
        for j in range(args.samples):
            out = lm.generate([ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              stop_tokens=stops, seed=j, capacity=args.capacity)  # fmt: skip
            text = tok.decode(out.rows()[0], skip_special_tokens=False)
            correct.append(float(check(record, text)) >= 1.0)
    return time.perf_counter() - began, float(np.mean(correct))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a run, checkpoint or HF directory with a tokenizer")
    parser.add_argument("--task", default="add:64")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=64, help="the one-at-a-time cache: prompt + answer")
    parser.add_argument("--check", default=None, help="default: the task's")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import zaya_jax
    from zaya_jax.eval.reasoning import read_task

    name, records, default_check = read_task(args.task)
    args.check = args.check or default_check or "zaya_jax.rewards:math_answer"
    lm = zaya_jax.load(args.model)
    answers = len(records) * args.samples
    print(f"# {platform.node()}; {args.model}; task {name}: {len(records)} prompts x {args.samples} samples, "
          f"<= {args.max_new_tokens} new tokens, T={args.temperature}")  # fmt: skip
    variants = {"engine (zaya eval --task)": _engine, "generate, one sample at a time": _one_at_a_time}
    small = records[:2]
    for run in variants.values():  # warm-up: compile each variant's programs
        run(lm, small, args)
    times: dict[str, list[float]] = {k: [] for k in variants}
    scores: dict[str, float] = {}
    for _ in range(args.rounds):
        for label, run in variants.items():
            seconds, scores[label] = run(lm, records, args)
            times[label].append(seconds)
    print("| variant | s (median of rounds) | answers/s | pass@1 |\n|---|---|---|---|")
    for label in variants:
        median = statistics.median(times[label])
        print(f"| {label} | {median:.2f} | {answers / median:.1f} | {scores[label]:.3f} |")
    ratio = statistics.median(times["generate, one sample at a time"]) / statistics.median(
        times["engine (zaya eval --task)"]
    )
    print(f"engine / one at a time: {ratio:.1f}x answers per second")


if __name__ == "__main__":
    main()
