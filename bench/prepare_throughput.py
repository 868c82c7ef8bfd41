"""Tokens per second of ``zaya data prepare`` against the ``tokenizers`` library's own
``encode_batch`` on the same texts and cores, and the scaling from 1 to 2 hosts under ``srun``.

A JSONL corpus of ``--mib`` MiB (pieces of the built-in corpus) and a byte-level BPE
``tokenizer.json`` trained on it; then, interleaved over ``--repeats`` rounds, each variant in its
own process: ``encode_batch`` over the texts already in memory (batches of 256, the library's
threads on every core), and ``zaya data prepare`` with 1 and 2 worker processes (read, parse,
tokenize, write the shards and the manifest; the ``seconds`` it reports). With a Slurm node up,
``srun -n 1`` and ``srun -n 2`` (two hosts on this machine, one worker each) too.

    python bench/prepare_throughput.py [--mib 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ENCODE = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(line)["text"] for line in open(sys.argv[2])]
start = time.perf_counter()
tokens = sum(len(e.ids) for i in range(0, len(texts), 256) for e in tok.encode_batch(texts[i : i + 256], add_special_tokens=False))
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""


def corpus(path: Path, mib: float) -> None:
    from zaya_jax.data import corpus as builtin

    _, texts, _ = builtin.read_stdlib()
    written, limit = 0, int(mib * 2**20)
    with path.open("w") as f:
        for text in texts:
            for i in range(0, len(text), 4000):
                line = json.dumps({"text": text[i : i + 4000]}) + "\n"
                f.write(line)
                written += len(line)
                if written >= limit:
                    return


def train_tokenizer(jsonl: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<pad>", "<eos>"])
    lines = (json.loads(line)["text"] for i, line in enumerate(jsonl.open()) if i < 2000)
    tok.train_from_iterator(lines, trainer)
    tok.save(str(out))


def run_prepare(tok: Path, jsonl: Path, out: Path, launcher: list[str], workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [*launcher, sys.executable, "-m", "zaya_jax.cli", "data", "prepare", str(jsonl), "--out", str(out)]
    cmd += ["--tokenizer", str(tok), "--workers", str(workers), "--shards", "8", "--unit-mb", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    decoder, text, found = json.JSONDecoder(), result.stdout, []
    while "{" in text:  # under srun -n 2 both tasks print a summary; host 0's has the tokens
        value, end = decoder.raw_decode(text[text.index("{") :])
        found.append(value)
        text = text[text.index("{") + end :]
    (summary,) = [value for value in found if "tokens" in value]
    return {"seconds": summary["seconds"], "tokens": summary["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    slurm = (
        shutil.which("srun") is not None
        and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        jsonl, tok = tmp / "corpus.jsonl", tmp / "tokenizer.json"
        corpus(jsonl, args.mib)
        train_tokenizer(jsonl, tok)
        variants = {
            "encode_batch (tokenizers, in memory)": lambda: json.loads(
                subprocess.run(
                    [sys.executable, "-c", ENCODE, str(tok), str(jsonl)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            ),
            "zaya data prepare --workers 1": lambda: run_prepare(tok, jsonl, tmp / "out", [], 1),
            "zaya data prepare --workers 2": lambda: run_prepare(tok, jsonl, tmp / "out", [], 2),
        }
        if slurm:
            variants["srun -n 1 zaya data prepare"] = lambda: run_prepare(
                tok, jsonl, tmp / "out", ["srun", "-n", "1"], 1
            )
            variants["srun -n 2 zaya data prepare"] = lambda: run_prepare(
                tok, jsonl, tmp / "out", ["srun", "-n", "2"], 1
            )
        rates: dict[str, list[float]] = {name: [] for name in variants}
        tokens = 0
        for _ in range(args.repeats):  # interleaved: every variant once per round
            for name, run in variants.items():
                result = run()
                tokens = result["tokens"]
                rates[name].append(result["tokens"] / result["seconds"])
    reference = statistics.median(rates["encode_batch (tokenizers, in memory)"])
    print(f"{args.mib:g} MiB of JSONL, {tokens:,} tokens, BPE vocab 8192, median of {args.repeats}\n")
    print("| variant | tokens/s | vs encode_batch |")
    print("|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median / 1e6:.2f} M | {median / reference:.2f}x |")


if __name__ == "__main__":
    main()
