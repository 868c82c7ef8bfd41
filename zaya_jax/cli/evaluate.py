"""``zaya eval`` and ``zaya generate``: the held-out loss of a model and its continuations of prompts,
for a run, a checkpoint or a Hugging Face directory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zaya_jax.cli.output import print_json

if TYPE_CHECKING:
    from zaya_jax.lm import LanguageModel


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _add_eval_command(sub)
    _add_generate_command(sub)


def _add_eval_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evaluate = sub.add_parser(
        "eval", help="held-out loss and perplexity of a run, checkpoint or HF directory"
    )
    evaluate.add_argument("path", help="run directory, checkpoint directory or HF save_pretrained directory")
    evaluate.add_argument(
        "--data",
        nargs="*",
        default=[],
        help="text/.jsonl/.parquet inputs (default: the run's held-out split); for a dpo, ipo or simpo run, "
        "JSONL files of preference pairs, scored by the run's loss",
    )
    evaluate.add_argument(
        "--tokenizer",
        help="'byte' or a tokenizer.json (default: the run's, or the HF directory's tokenizer.json)",
    )
    evaluate.add_argument(
        "--seq-len",
        type=int,
        help="tokens per row (default: a run's train.seq_len and held-out batches, else 512)",
    )
    evaluate.add_argument(
        "--batch-size", type=int, help="rows per batch (default: the run's train.batch_size, else 8)"
    )
    evaluate.add_argument(
        "--batches",
        type=int,
        help="at most this many batches (default: the run's eval.batches, else 16)",
    )
    evaluate.add_argument("--json", action="store_true", help='print {"loss", "perplexity", "tokens"}')
    evaluate.add_argument(
        "--quantize",
        choices=["fp8-experts", "mxfp4-experts"],
        help="what that quantized export changes against the bfloat16 one: size, held-out loss, greedy "
        "agreement, and the share of tokens each layer routes elsewhere (zaya_jax.eval.quantization)",
    )
    _add_reasoning_options(evaluate)
    _add_long_context_options(evaluate)
    evaluate.set_defaults(func=_cmd_eval)


def _add_long_context_options(evaluate: argparse.ArgumentParser) -> None:
    """``zaya eval PATH --passkey 512,2048`` and ``--by-position 8`` (zaya_jax.eval.long_context)."""
    group = evaluate.add_argument_group("long-context checks: did a context extension work")
    group.add_argument(
        "--passkey", help="passkey retrieval at these lengths in tokens, comma-separated (e.g. 4096,16384)"
    )
    group.add_argument(
        "--depths", default="0,0.25,0.5,0.75,1", help="where the key is hidden, fractions of the filler"
    )
    group.add_argument("--passkey-prompts", type=int, default=10, help="checks per length and depth")
    group.add_argument(
        "--by-position",
        type=int,
        metavar="BUCKETS",
        help="the held-out loss by position in the document, in this many spans of --seq-len",
    )


def _add_reasoning_options(evaluate: argparse.ArgumentParser) -> None:
    """``zaya eval PATH --task ...``: sampled answers checked and scored (zaya_jax.eval.reasoning)."""
    group = evaluate.add_argument_group("reasoning evaluation (--task): sampled answers, checked and scored")
    group.add_argument(
        "--task",
        help="a JSONL file of chat records with answers, or a built-in task (add, reverse, sort; NAME:PROMPTS)",
    )
    group.add_argument("--samples", type=int, default=8, help="answers sampled per prompt (n, default 8)")
    group.add_argument("--k", help="the k of pass@k and maj@k, comma-separated (default: 1 and --samples)")
    group.add_argument(
        "--check", help="module:function scoring an answer (default: the task's, else math_answer)"
    )
    group.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0: greedy)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--max-new-tokens", type=int, default=512, help="the token budget of an answer")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--slots", type=int, default=64, help="answers in flight at once in the rollout engine"
    )
    group.add_argument(
        "--out",
        help="where scores.json and samples.jsonl go (default: RUN/evals/TASK/step-N, else evals/TASK)",
    )
    group.add_argument(
        "--checkpoints",
        help="evaluate every kept step of the run (all), every K-th (every:K) or a list (S,S): one curve in "
        "RUN/evals/TASK/curve.jsonl; steps evaluated already are skipped",
    )


def _add_generate_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser("generate", help="continue text prompts with the CCA decode cache")
    gen.add_argument("path", help="run directory, checkpoint directory or HF save_pretrained directory")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    gen.add_argument(
        "--interactive",
        action="store_true",
        help="read prompts from stdin, one per line, compiling once (the cache holds --max-prompt-tokens + --max-new-tokens)",
    )
    gen.add_argument("--max-prompt-tokens", type=int, default=256, help="with --interactive: longest prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--stop", type=int, action="append", help="stop token id (default: the tokenizer's EOS)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's)")
    gen.add_argument("--json", action="store_true", help='print [{"prompt", "text", "tokens", "stopped"}]')
    gen.set_defaults(func=_cmd_generate)


def _cmd_eval(args: argparse.Namespace) -> int:
    from zaya_jax.lm import evaluate_path

    if args.quantize and (args.task or args.passkey or args.by_position or args.checkpoints):
        raise ValueError(
            "--quantize compares a quantized export with the bfloat16 one on held-out text; give it "
            "without --task, --passkey, --by-position or --checkpoints"
        )
    if args.task:
        return _cmd_reasoning(args)
    if args.passkey or args.by_position:
        return _cmd_long_context(args)
    if args.quantize:
        return _cmd_quantized(args)
    if args.checkpoints:
        raise ValueError("--checkpoints evaluates a --task over a run's steps; give --task FILE_OR_NAME")
    result = evaluate_path(
        args.path,
        args.data,
        tokenizer=args.tokenizer,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_batches=args.batches,
        progress=sys.stderr.isatty(),
    )
    print(f"zaya eval: {result.pop('evaluated')}", file=sys.stderr)
    if args.json:
        print_json(result)
    elif "reward" in result:
        print(f"mean reward {result['reward']:.4f} over {result['prompts']:,} held-out prompts")
        for name in (k for k in result if "@" in k):  # rl.eval_samples: the sampled scores
            print(f"{name:>8} {result[name]:.4f}")
    elif "pair_accuracy" in result:
        print(
            f"loss {result['loss']:.4f} per pair, pair accuracy {result['pair_accuracy']:.1%}, reward margin "
            f"{result['reward_margin']:.4f} over {result['pairs']:,} pairs"
        )
    else:
        print(
            f"loss {result['loss']:.4f} nats/token, perplexity {result['perplexity']:.3f} over {result['tokens']:,} tokens"
        )
    return 0


def _cmd_quantized(args: argparse.Namespace) -> int:
    from zaya_jax.config import DataConfig
    from zaya_jax.data.sources import source_for_path
    from zaya_jax.eval import ordered_batches
    from zaya_jax.eval.quantization import quantization_report
    from zaya_jax.lm import load

    lm = load(args.path, args.tokenizer)
    if lm.tokenizer is None:
        raise ValueError(f"{lm.tokenizer_problem}; pass the model's tokenizer (--tokenizer PATH or 'byte')")
    data = lm.run_config.data if lm.run_config is not None else DataConfig()
    split = "held_out"
    if args.data:
        data, split = dataclasses.replace(data, sources=tuple(source_for_path(p) for p in args.data)), "all"
    shape = (args.seq_len or 512, args.batch_size or 8, args.batches or 16)
    report = quantization_report(lm, args.quantize, ordered_batches(lm, data, lm.tokenizer, split, *shape))
    if args.json:
        print_json(report)
        return 0
    kind, sizes, loss = args.quantize, report["bytes"], report["loss"]
    print(
        f"size {sizes[kind] / 1e6:,.1f} MB against {sizes['bfloat16'] / 1e6:,.1f} MB in bfloat16 "
        f"({report['size_ratio']:.3f}x)"
    )
    print(
        f"held-out loss {loss[kind]:.4f} against {loss['bfloat16']:.4f} ({report['loss_change']:+.4f}) over "
        f"{report['tokens']:,} tokens; greedy agreement {report['greedy_agreement']:.2%}"
    )
    skips = report["skip_share_by_layer"]
    for layer, moved in enumerate(report["route_change_by_layer"]):
        print(
            f"layer {layer:>3}: {moved:.2%} of tokens routed elsewhere; skip class {skips['bfloat16'][layer]:.2%} -> "
            f"{skips[kind][layer]:.2%}"
        )
    return 0


def _cmd_long_context(args: argparse.Namespace) -> int:
    from zaya_jax.config import DataConfig
    from zaya_jax.data.sources import source_for_path
    from zaya_jax.eval.long_context import loss_by_position, passkey_accuracy
    from zaya_jax.lm import load

    lengths = [int(x) for x in args.passkey.split(",")] if args.passkey else []
    depths = [float(x) for x in args.depths.split(",")]
    lm = load(args.path, args.tokenizer)
    if lm.tokenizer is None:
        raise ValueError(f"{lm.tokenizer_problem}; pass the model's tokenizer (--tokenizer PATH or 'byte')")
    result: dict[str, Any] = {"step": lm.step}
    batch = args.batch_size or 8
    if lengths:
        result["passkey"] = [
            passkey_accuracy(lm, lm.tokenizer, n, depths=depths, prompts=args.passkey_prompts,
                             batch_size=batch, seed=args.seed)
            for n in lengths
        ]  # fmt: skip
    if args.by_position:
        data = lm.run_config.data if lm.run_config is not None else DataConfig()
        split = "held_out"
        if args.data:
            data, split = (
                dataclasses.replace(data, sources=tuple(source_for_path(p) for p in args.data)),
                "all",
            )
        result["loss"] = loss_by_position(
            lm, data, buckets=args.by_position, seq_len=args.seq_len or 512, batch_size=batch,
            max_batches=args.batches or 16, tokenizer=lm.tokenizer, split=split,
        )  # fmt: skip
    if args.json:
        print_json(result)
        return 0
    for check in result.get("passkey", []):
        depths_line = ", ".join(f"{d} {acc:.0%}" for d, acc in check["by_depth"].items())
        print(
            f"passkey at {check['length']:,} tokens: {check['accuracy']:.1%} of {check['checks']} ({depths_line})"
        )
    if "loss" in result:
        for span in result["loss"]["by_position"]:
            loss = "-" if span["loss"] is None else f"{span['loss']:.4f}"
            print(
                f"positions {span['from']:>7,}-{span['to'] - 1:<7,} loss {loss} over {span['tokens']:,} tokens"
            )
    return 0


def _cmd_reasoning(args: argparse.Namespace) -> int:
    from zaya_jax.eval.reasoning import read_task
    from zaya_jax.scoring.metrics import check_k

    name, records, default_check = read_task(args.task)
    ks = [int(k) for k in args.k.split(",")] if args.k else sorted({1, args.samples})
    for k in ks:  # before the model loads
        check_k(args.samples, k)
    check = args.check or default_check or "zaya_jax.rewards:math_answer"
    settings = {"task": args.task, "samples": args.samples, "ks": sorted(set(ks)), "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "max_new_tokens": args.max_new_tokens,
                "seed": args.seed, "check": check}  # fmt: skip

    def evaluate(path: Path, out: Path | None) -> dict[str, Any]:
        return _reasoning_step(args, path, out, name, records, settings)

    if args.checkpoints:
        return _over_checkpoints(args, name, settings, evaluate)
    summary = evaluate(Path(args.path), Path(args.out) if args.out else None)
    if args.json:
        print_json(summary)
        return 0
    for metric in summary["metrics"]:
        print(f"{metric:>8} {summary[metric]:.4f} ± {summary[metric + '_stderr']:.4f}")
    print(f"truncated {summary['truncated']:.1%} of answers (no stop within {args.max_new_tokens} tokens), "
          f"unparsed {summary['unparsed']:.1%}")  # fmt: skip
    return 0


def _reasoning_step(
    args: argparse.Namespace, path: Path, out: Path | None, name: str, records: list, settings: dict[str, Any]
) -> dict[str, Any]:
    """One model's reasoning evaluation, written to ``out`` (default: beside the run)."""
    from tqdm import tqdm

    from zaya_jax.eval.reasoning import evaluate_reasoning
    from zaya_jax.lm import load

    lm = load(path, args.tokenizer)
    bar = tqdm(total=len(records) * args.samples, unit="answer", disable=not sys.stderr.isatty())

    def advance(done: int, _total: int) -> None:
        bar.update(done - bar.n)

    options = {k: v for k, v in settings.items() if k != "task"}
    result = evaluate_reasoning(lm, records, slots=args.slots, task=name, on_finish=advance, **options)
    result.settings = settings
    bar.close()
    out = result.write(out or _eval_directory(path, name, lm.step))
    print(f"zaya eval: {path} on {name}: {len(records):,} prompts x {args.samples} samples -> {out}",
          file=sys.stderr)  # fmt: skip
    return result.summary()


def _over_checkpoints(args: argparse.Namespace, name: str, settings: dict[str, Any], evaluate: Any) -> int:
    """``--checkpoints``: each chosen step evaluated (finished ones skipped), then the curve."""
    from zaya_jax.eval.checkpoints import CURVE, evaluate_checkpoints, select_steps

    steps = select_steps(args.path, args.checkpoints)
    out = Path(args.out) if args.out else Path(args.path) / "evals" / name
    curve = evaluate_checkpoints(args.path, steps, out, settings, evaluate,
                                 say=lambda line: print(f"zaya eval: {line}", file=sys.stderr))  # fmt: skip
    print(f"zaya eval: {len(steps)} steps -> {out / CURVE}", file=sys.stderr)
    if args.json:
        print_json([{"step": step, **scores} for step, scores in zip(steps, curve, strict=True)])
        return 0
    metrics = curve[0]["metrics"]
    print("| step | " + " | ".join(metrics) + " | truncated | unparsed |")
    print("|---" * (len(metrics) + 3) + "|")
    for step, scores in zip(steps, curve, strict=True):
        cells = [f"{scores[m]:.4f} ± {scores[m + '_stderr']:.4f}" for m in metrics]
        print(
            f"| {step} | " + " | ".join(cells) + f" | {scores['truncated']:.1%} | {scores['unparsed']:.1%} |"
        )
    return 0


def _eval_directory(path: Path, task: str, step: int | None) -> Path:
    """A run's (or its checkpoint's) ``evals/TASK/step-N``; else ``evals/TASK`` here."""
    if (path / "checkpoints").is_dir():
        return path / "evals" / task / f"step-{step}"
    if path.parent.name == "checkpoints":
        return path.parent.parent / "evals" / task / f"step-{step}"
    return Path("evals") / task


def _cmd_generate(args: argparse.Namespace) -> int:
    from zaya_jax.lm import load

    lm = load(args.path, args.tokenizer)
    if args.interactive:
        return _interactive(lm, args)
    if not args.prompt:
        raise ValueError(
            "give a prompt (--prompt TEXT, repeatable) or --interactive to read prompts from stdin"
        )
    out = lm.generate(args.prompt, **_sampling(args))
    results = [
        {"prompt": prompt, "text": text, "tokens": row, "stopped": bool(stopped)}
        for prompt, text, row, stopped in zip(args.prompt, out.texts, out.rows(), out.stopped, strict=True)
    ]
    if args.json:
        print_json(results)
    else:
        for result in results:
            print(result["prompt"] + result["text"])
    return 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The generation options of ``zaya generate``, as keyword arguments of ``LanguageModel.generate``."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "stop_tokens": args.stop,
        "seed": args.seed,
    }


def _interactive(lm: LanguageModel, args: argparse.Namespace) -> int:
    """Prompts from stdin, one per line, up to ``--max-prompt-tokens`` each: the engine's cache
    holds that many plus ``--max-new-tokens`` for every prompt, so the programs compile once."""
    if lm.tokenizer is None:
        raise ValueError(
            f"--interactive needs a tokenizer: {lm.tokenizer_problem}; pass --tokenizer PATH (or 'byte')"
        )
    width = args.max_prompt_tokens
    for line in sys.stdin:
        prompt = line.rstrip("\n")
        if not prompt:
            continue
        ids = lm.tokenizer.encode(prompt)
        if len(ids) > width:
            print(
                f"zaya generate: the prompt has {len(ids)} tokens, more than --max-prompt-tokens={width}",
                file=sys.stderr,
            )
            continue
        out = lm.generate([ids.tolist()], capacity=width + args.max_new_tokens, **_sampling(args))
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.texts[0], "tokens": out.rows()[0]}), flush=True)
        else:
            print(prompt + out.texts[0], flush=True)
    return 0
