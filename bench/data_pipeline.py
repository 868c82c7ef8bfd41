"""Input pipeline throughput against what the train step consumes, measured in one run.

The producer is the one ``zaya train`` runs (``BatchProducer``: Grain packing of shuffled
documents into rows, the batch ramp and curriculum plan, data state for checkpoints), read for
``--batches`` batches after its first (whose latency, tokenizing or opening the sources, is
reported apart). Sources: the built-in corpus (byte tokenizer, tokenized in memory at start) and
the same text prepared into ArrayRecord shards with ``zaya data prepare`` (read from disk).
Consumption is the jitted train step of the same config and batch. Prints tokens/s of each and
their ratio (how many times faster the loader is than training needs). Usage:

    python bench/data_pipeline.py [--config tiny] [--batches 200] [--prepared-mib 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import zaya_jax
from zaya_jax.config import DataSource
from zaya_jax.data import load_tokenizer, prepare
from zaya_jax.data.corpus import read_stdlib
from zaya_jax.objectives import build_programs
from zaya_jax.objectives.lm import BatchProducer


def producer_rate(cfg, batches: int) -> dict[str, float]:
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    producer = BatchProducer(cfg, tokenizer)
    start = time.perf_counter()
    _, batch, _ = producer()
    first = time.perf_counter() - start
    tokens = 0
    start = time.perf_counter()
    for _ in range(batches):
        _, batch, _ = producer()
        tokens += batch["inputs"].size
    elapsed = time.perf_counter() - start
    return {"first_batch_s": first, "tokens_per_s": tokens / elapsed}


def step_rate(cfg, repeats: int = 5) -> float:
    programs = build_programs(cfg, devices=jax.devices()[:1])  # the step `zaya train` runs
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    _, host, _ = BatchProducer(cfg, tokenizer)()
    batch = {k: jnp.asarray(v) for k, v in host.items()}
    state = programs.init_state()
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        state, metrics = programs.train_step(*programs.step_arguments(state, batch))
        jax.block_until_ready(metrics["loss"])
        if i:  # the first call compiles
            best = min(best, time.perf_counter() - start)
    return batch["inputs"].size / best


def prepared_corpus(out: Path, mib: float) -> Path:
    """ArrayRecord shards (``zaya data prepare``) of the first ``mib`` MiB of the built-in corpus,
    written as a JSONL file of documents first."""
    _, texts, _ = read_stdlib()
    chosen, size = [], 0
    for text in texts:
        chosen.append(text)
        size += len(text)
        if size >= mib * 2**20:
            break
    jsonl = out.parent / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in chosen))
    prepare([str(jsonl)], out, "byte", num_shards=4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--prepared-mib", type=float, default=32.0)
    args = parser.parse_args()

    cfg = zaya_jax.load_config(args.config)
    consume = step_rate(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        shards = prepared_corpus(Path(tmp) / "prepared", args.prepared_mib)
        prepared_cfg = dataclasses.replace(
            cfg,
            data=dataclasses.replace(
                cfg.data, sources=(DataSource(name="prepared", kind="arrayrecord", path=str(shards)),)
            ),
        )
        sources = {"builtin_corpus": cfg, "arrayrecord_shards": prepared_cfg}
        produced = {name: producer_rate(c, args.batches) for name, c in sources.items()}
    report = {
        "shape": {"config": args.config, "batch": cfg.train.batch_size, "seq": cfg.train.seq_len},
        "train_step_tokens_per_s": round(consume),
        "loader": {
            name: {
                "tokens_per_s": round(r["tokens_per_s"]),
                "first_batch_s": round(r["first_batch_s"], 3),
                "ratio_vs_step": round(r["tokens_per_s"] / consume, 1),
            }
            for name, r in produced.items()
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
