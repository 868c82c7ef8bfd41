"""``zaya data prepare``: documents tokenized into ArrayRecord shards and a manifest."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from zaya_jax.cli.output import print_json


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = sub.add_parser("data", help="data preparation")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser("prepare", help="tokenize inputs into ArrayRecord shards plus a manifest")
    prepare.add_argument(
        "inputs",
        nargs="+",
        help="text files, directories, globs, .jsonl or .parquet files (.gz/.zst compressed too)",
    )
    prepare.add_argument("--out", required=True, help="new output directory")
    prepare.add_argument("--tokenizer", default="byte", help="'byte' or a path to an HF tokenizer.json")
    prepare.add_argument("--shards", type=int, default=4, help="number of ArrayRecord shards")
    prepare.add_argument(
        "--text-field",
        default="text",
        help="the JSONL field / Parquet column holding the text (default: text)",
    )
    prepare.add_argument(
        "--format",
        choices=["auto", "text", "chat"],
        default="auto",
        dest="data_format",
        help="chat: JSONL conversations ({'messages': [...]}) trained on the assistant turns; auto "
        "(default): chat for JSONL whose first record has 'messages' and no text field, else text",
    )
    prepare.add_argument(
        "--chat-template",
        help="a Jinja chat-template file (default: the tokenizer's own; the byte tokenizer's built-in one)",
    )
    prepare.add_argument(
        "--on-bad-document",
        choices=["error", "skip"],
        default="error",
        help="a document that cannot be read: stop with its name (default) or skip and count it",
    )
    prepare.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenizing processes on this host (default 1; e.g. the number of cores)",
    )
    prepare.add_argument(
        "--num-hosts",
        type=int,
        help="hosts sharing the preparation, each running this command (default: the srun step's "
        "SLURM_NTASKS, else 1); host 0 writes the output",
    )
    prepare.add_argument("--host-index", type=int, help="this host's index (default: SLURM_PROCID, else 0)")
    prepare.add_argument(
        "--unit-mb",
        type=float,
        default=32,
        help="large uncompressed JSONL files are cut into units of about this many MB (default 32)",
    )
    prepare.set_defaults(func=_cmd_data_prepare)
    example = data_sub.add_parser(
        "example-chat", help="write the built-in reverse-a-word chat task as JSONL (for SFT on tiny)"
    )
    example.add_argument("out", help="the JSONL file to write")
    example.add_argument("--records", type=int, default=4000, help="number of conversations (default 4000)")
    example.add_argument("--seed", type=int, default=0, help="random seed (another seed: other words)")
    example.set_defaults(func=_cmd_example, kind="chat")
    pairs = data_sub.add_parser(
        "example-preference",
        help="write the built-in reverse task's preference pairs as JSONL (reversed word chosen over a copy)",
    )
    pairs.add_argument("out", help="the JSONL file to write")
    pairs.add_argument("--records", type=int, default=4000, help="number of pairs (default 4000)")
    pairs.add_argument("--seed", type=int, default=0, help="random seed (another seed: other words)")
    pairs.set_defaults(func=_cmd_example, kind="preference")


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    import os
    import sys
    import time

    from zaya_jax.data import prepare

    num_hosts, host_index = hosts(args.num_hosts, args.host_index, os.environ)
    started, shown = time.perf_counter(), {"at": 0.0}

    def progress(what: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if done == total or now - shown["at"] > 10:
            shown["at"] = now
            print(f"zaya data prepare: host {host_index}: {done}/{total} {what}", file=sys.stderr, flush=True)

    result = prepare(
        args.inputs,
        args.out,
        tokenizer_spec=args.tokenizer,
        num_shards=args.shards,
        on_bad_document=args.on_bad_document,
        text_field=args.text_field,
        data_format=args.data_format,
        chat_template=args.chat_template,
        workers=args.workers,
        num_hosts=num_hosts,
        host_index=host_index,
        unit_bytes=max(1, int(args.unit_mb * 2**20)),
        progress=progress,
    )
    summary = {k: v for k, v in result.items() if k != "shards"}
    print_json({**summary, "seconds": round(time.perf_counter() - started, 3)})
    return 0


def hosts(num_hosts: int | None, host_index: int | None, env: Mapping[str, str]) -> tuple[int, int]:
    """(num_hosts, host_index): the flags, else an srun step's task count and rank, else (1, 0)."""
    in_step = "SLURM_STEP_ID" in env and "SLURM_NTASKS" in env and "SLURM_PROCID" in env
    if num_hosts is None:
        num_hosts = int(env["SLURM_NTASKS"]) if in_step else 1
    if host_index is None:
        host_index = int(env["SLURM_PROCID"]) if in_step and num_hosts > 1 else 0
    return num_hosts, host_index


def _cmd_example(args: argparse.Namespace) -> int:
    from pathlib import Path

    from zaya_jax.data.tasks import reverse_chats, reverse_pairs, write_jsonl

    if args.records < 1:
        raise ValueError(f"--records {args.records} must be >= 1")
    if Path(args.out).exists():
        raise FileExistsError(f"{args.out} exists; choose a new file (nothing is overwritten)")
    make = reverse_chats if args.kind == "chat" else reverse_pairs
    path = write_jsonl(args.out, make(args.records, seed=args.seed))
    print_json(
        {"path": str(path), "records": args.records, "task": "reverse", "kind": args.kind, "seed": args.seed}
    )
    return 0
