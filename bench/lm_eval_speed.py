"""Log-likelihood requests per second of the lm-eval ``zaya`` model (:mod:`zaya_jax.harness`,
batched by :mod:`zaya_jax.scoring.likelihood`) against what it did before (one padded forward
pass per request, the code this replaced, kept here) and against lm-eval's ``hf`` model on the HF
export of the same weights (float32, CPU, ``--hf-batch-size`` rows a forward).

The requests are a multiple-choice task of our own: ``--questions`` questions of 4 answers each,
half of them passages of 40-160 words with answers of 1-6 words (as ARC or HellaSwag), half with
one-letter answers (as MMLU, where ``hf`` reads a question once for its four letters). Each
variant runs in its own process (JAX and PyTorch never share one), scores every request once to
compile and warm up, then once timed; the variants alternate round by round. The table gives the
median time and each variant's largest difference from the ``zaya`` model's log-likelihoods, and
whether the greedy flags agree.

    python bench/lm_eval_speed.py [--workdir DIR] [--questions 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "the",
    "a",
    "of",
    "river",
    "stone",
    "light",
    "north",
    "winter",
    "signal",
    "market",
    "garden",
    "engine",
    "paper",
    "quiet",
    "bright",
    "seven",
    "across",
    "under",
    "before",
    "after",
    "carry",
    "build",
    "measure",
    "open",
    "close",
    "follow",
    "young",
    "old",
    "green",
    "cold",
    "warm",
    "small",
    "large",
    "many",
    "few",
    "first",
    "last",
    "city",
    "field",
    "window",
    "letter",
    "answer",
    "question",
]


def _requests(questions: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for q in range(questions):
        passage = " ".join(rng.choice(WORDS, rng.integers(40, 160)))
        if q % 2:
            context = f"{passage}\nQuestion: which word comes first?\nA. river\nB. stone\nC. light\nD. north\nAnswer:"
            out += [(context, f" {letter}") for letter in "ABCD"]
        else:
            context = f"{passage}\nQuestion: what follows?\nAnswer:"
            out += [(context, " " + " ".join(rng.choice(WORDS, rng.integers(1, 7)))) for _ in range(4)]
    return out


def _setup(work: Path, override: list[str]) -> tuple[Path, Path]:
    """A ``tiny`` run (one step: speed does not depend on the weights) with a BPE tokenizer
    trained on the task's words, and its HF export."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    run, hf = work / "run", work / "hf"
    if (hf / "config.json").exists():
        return run, hf
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<pad>", "</s>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    texts = [c + a for c, a in _requests(200, seed=1)]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(work / "tokenizer.json"))
    (work / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    subprocess.run(
        [sys.executable, "-m", "zaya_jax.cli", "train", "tiny", f"run.dir={run}", "train.steps=1",
         "model.vocab_size=2048", f"data.tokenizer={work / 'tokenizer.json'}", "eval.every=1000",
         f"data.sources=[{{name: c, kind: jsonl, path: {work / 'corpus.jsonl'}}}]", *override, "--no-progress"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "zaya_jax.cli", "convert", "zaya-to-hf", str(run), str(hf)], check=True
    )
    return run, hf


class _OneAtATime:
    """The ``zaya`` model's loglikelihood before batching: one forward per request, left-padded
    to the next power of two (at least 16 tokens), the whole logits brought to the host."""

    def __init__(self, path: str):
        from zaya_jax.harness import ZayaLM

        self.model = ZayaLM(path)

    def loglikelihood(self, requests):
        lm, model = self.model.lm, self.model
        out = []
        for context, continuation in (r.args for r in requests):
            head, tail = model._encode_pair(context, continuation)
            ids = (head + tail)[-(model.max_length + 1) :]
            inputs, targets = ids[:-1], ids[1:]
            width = max(16, 1 << (len(inputs) - 1).bit_length())
            padded = np.full((1, width), lm.config.pad_token_id, np.int32)
            padded[0, width - len(inputs) :] = inputs
            mask = (np.arange(width) >= width - len(inputs))[None].astype(np.int32)
            logits = lm.logits(padded, attention_mask=mask)[0, width - len(tail) :]
            logits = logits - logits.max(-1, keepdims=True)
            logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            wanted = np.asarray(targets[-len(tail) :])
            out.append((float(logprobs[np.arange(len(wanted)), wanted].sum()),
                        bool(np.array_equal(logits.argmax(-1), wanted))))  # fmt: skip
        return out


def _child(variant: str, path: str, questions: int, hf_batch_size: int, batch_tokens: int) -> None:
    if variant == "hf":
        from lm_eval.models.huggingface import HFLM

        model = HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=hf_batch_size)
    elif variant == "zaya":
        from zaya_jax.harness import ZayaLM

        model = ZayaLM(path, batch_tokens=batch_tokens)
    else:
        model = _OneAtATime(path)
    requests = [types.SimpleNamespace(args=pair) for pair in _requests(questions)]
    model.loglikelihood(requests)  # compile, warm up
    began = time.perf_counter()
    results = model.loglikelihood(requests)
    seconds = time.perf_counter() - began
    print(json.dumps({"seconds": seconds, "results": [[float(a), bool(b)] for a, b in results]}))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", help="the run and its export (default: a temporary directory)")
    parser.add_argument("--questions", type=int, default=300, help="4 requests each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=4096, help="the zaya model's tokens per forward")
    parser.add_argument(
        "--override", action="append", default=[], help="a model override for the run (repeat)"
    )
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="zaya-lm-eval-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run, hf = _setup(work, args.override)
    variants = {
        "zaya (batched)": ("zaya", run),
        "zaya before (one forward per request)": ("old", run),
        f"lm-eval hf, batch {args.hf_batch_size}": ("hf", hf),
    }
    requests = 4 * args.questions
    print(
        f"# {platform.node()} ({len(os.sched_getaffinity(0))} cores); {requests} loglikelihood requests; {work}"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    times, results = {name: [] for name in variants}, {}
    for _ in range(args.rounds):
        for name, (variant, path) in variants.items():
            command = [sys.executable, __file__, "--child", variant, str(path), str(args.questions),
                       str(args.hf_batch_size), str(args.batch_tokens)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            report = json.loads(done.stdout.strip().splitlines()[-1])
            times[name].append(report["seconds"])
            results[name] = report["results"]
    reference = results[f"lm-eval hf, batch {args.hf_batch_size}"]
    theirs, greedy = np.asarray([r[0] for r in reference]), [r[1] for r in reference]
    base = statistics.median(times["zaya (batched)"])
    print(f"rounds: {args.rounds}; batch_tokens {args.batch_tokens}")
    print("| variant | median s | requests/s | zaya's speed-up | max abs diff from hf | max relative diff | "
          "greedy flags as hf |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name in variants:
        median = statistics.median(times[name])
        diff = np.abs(np.asarray([r[0] for r in results[name]]) - theirs)
        same = [r[1] for r in results[name]] == greedy
        print(f"| {name} | {median:.2f} | {requests / median:.0f} | {median / base:.2f}x | {diff.max():.1e} | "
              f"{(diff / np.abs(theirs)).max():.1e} | {same} |")  # fmt: skip


if __name__ == "__main__":
    main()
