"""The rollout engine against the static sampler and HF ``generate`` on an RL-shaped workload.

64 prompts (16-128 tokens), a group of 8 completions each (512 rows), completion lengths drawn from
a wide distribution (log-normal, median 48, clipped to 4-256: what EOS does to sampled completions,
made repeatable). One model (the ``--config`` preset's shapes, ``tiny`` by default; HF's random init) saved once with
``save_pretrained``; each variant loads those files in its own process, runs the whole workload once
to compile (JAX) or warm up (PyTorch), then once timed, greedy:

- ``engine``: :class:`zaya_jax.engine.Engine`, 64 slots, each row stopping at its own length, a
  group's prompt read once (``share_prompts``); ``engine, prompts unshared``: each row reads its own;
- ``static``: :func:`zaya_jax.generate.static_generate`, batches of 64 rows, each batch decoding
  until its longest row is done (rows truncated to their own lengths afterwards);
- ``hf``: ``ZayaForCausalLM.generate`` with its cache, the same batches of 64, left-padded.

New tokens/s counts the tokens each row keeps (the same count for all three). The engine's and the
static sampler's tokens must be equal (checked: the run fails otherwise); the share of HF's rows
equal to the engine's is printed (two frameworks' float sums may break a near-tie differently).
Variants run in separate processes, interleaved over ``--rounds``; the best time of each is kept.

    python bench/engine.py [--prompts 64] [--group 8] [--slots 64] [--rounds 2] [--config tiny] [--engine-only]

On a GPU both frameworks run there (JAX's default device; PyTorch's "cuda", which ROCm's build
also answers to).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def workload(prompts: int, group: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompt ids per row, new tokens per row): each prompt repeated ``group`` times."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, vocab, rng.integers(16, 129)).tolist() for _ in range(prompts)]
    rows = [p for p in ids for _ in range(group)]
    lengths = np.clip(np.round(48 * np.exp(0.9 * rng.standard_normal(len(rows)))), 4, 256).astype(int)
    return rows, lengths.tolist()


def _batches(n: int, size: int):
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def run_engine(directory: Path, rows, lengths, slots: int, share_prompts: bool = True) -> list[list[int]]:
    from zaya_jax.engine import Engine, Request
    from zaya_jax.interop.hf import load_hf_directory

    cfg, variables = load_hf_directory(directory)
    engine = Engine(cfg, variables, slots=slots, prefill_chunk=128, share_prompts=share_prompts)
    results = engine.run([Request(p, n) for p, n in zip(rows, lengths, strict=True)])
    return [r.tokens.tolist() for r in results]


def run_engine_unshared(directory: Path, rows, lengths, slots: int) -> list[list[int]]:
    """The engine with every row reading its own prompt (``share_prompts=False``)."""
    return run_engine(directory, rows, lengths, slots, share_prompts=False)


def run_static(directory: Path, rows, lengths, slots: int) -> list[list[int]]:
    from zaya_jax.generate import static_generate
    from zaya_jax.interop.hf import load_hf_directory

    cfg, variables = load_hf_directory(directory)
    out = []
    for batch in _batches(len(rows), slots):
        longest = max(lengths[i] for i in batch)
        gen = static_generate(
            cfg, variables, [rows[i] for i in batch], max_new_tokens=longest, stop_tokens=[]
        )
        out += [gen.tokens[j, : lengths[i]].tolist() for j, i in enumerate(batch)]
    return out


def run_hf(directory: Path, rows, lengths, slots: int) -> list[list[int]]:
    import torch
    import transformers

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # ROCm's torch also answers to "cuda"
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval().to(device)
    )
    out = []
    for batch in _batches(len(rows), slots):
        width, longest = max(len(rows[i]) for i in batch), max(lengths[i] for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, i in enumerate(batch):
            ids[j, width - len(rows[i]) :] = torch.as_tensor(rows[i])
            mask[j, width - len(rows[i]) :] = 1
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        out += [gen[j, width : width + lengths[i]].cpu().tolist() for j, i in enumerate(batch)]
    return out


PARTS = {
    "engine": run_engine,
    "engine, prompts unshared": run_engine_unshared,
    "static": run_static,
    "hf": run_hf,
}


def part(args: argparse.Namespace) -> None:
    """One variant in this process: a warm-up pass, then the timed pass; JSON on stdout."""
    rows, lengths = json.loads(Path(args.workload).read_text())
    fn = PARTS[args.part]
    fn(Path(args.dir), rows, lengths, args.slots)
    start = time.perf_counter()
    tokens = fn(Path(args.dir), rows, lengths, args.slots)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--config", default="tiny", help="the preset whose model shapes are used")
    parser.add_argument("--part", choices=sorted(PARTS))
    parser.add_argument("--dir")
    parser.add_argument("--workload")
    parser.add_argument(
        "--engine-only", action="store_true", help="the two engine variants only (what prompt sharing saves)"
    )
    args = parser.parse_args()
    if args.part:
        return part(args)

    import torch
    import transformers

    import zaya_jax
    from zaya_jax.interop.hf import model_to_hf_config

    cfg = zaya_jax.load_config(args.config).model
    rows, lengths = workload(args.prompts, args.group, cfg.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        hf_cfg = transformers.ZayaConfig(**model_to_hf_config(cfg))
        transformers.ZayaForCausalLM(hf_cfg).save_pretrained(tmp)
        spec = Path(tmp) / "workload.json"
        spec.write_text(json.dumps([rows, lengths]))
        best: dict[str, float] = {}
        tokens: dict[str, list[list[int]]] = {}
        names = [n for n in PARTS if n.startswith("engine") or not args.engine_only]
        for _ in range(args.rounds):
            for name in names:
                cmd = [sys.executable, __file__, "--part", name, "--dir", tmp, "--workload", str(spec)]
                result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                best[name] = min(best.get(name, float("inf")), result["seconds"])
                tokens[name] = result["tokens"]
                print(f"{name}: {result['seconds']:.2f} s", file=sys.stderr)
    if any(tokens[name] != tokens["engine"] for name in names if name != "hf"):
        raise SystemExit(
            "the engine's greedy tokens differ from the static sampler's or the unshared engine's"
        )
    new = sum(lengths)
    print(
        f"{len(rows)} rows ({args.prompts} prompts x {args.group}), {new} new tokens, slots/batch {args.slots}"
    )
    print("| variant | time | new tokens/s | engine's speed-up |")
    print("|---|---|---|---|")
    for name in names:
        print(
            f"| {name} | {best[name]:.2f} s | {new / best[name]:,.0f} | {best[name] / best['engine']:.2f}x |"
        )
    if "hf" in tokens:
        same_hf = np.mean([a == b for a, b in zip(tokens["engine"], tokens["hf"], strict=True)])
        print(f"engine = static tokens: yes; HF rows equal to the engine's: {same_hf:.1%}")


if __name__ == "__main__":
    main()
