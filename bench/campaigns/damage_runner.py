"""Runs the damaged-input campaign (cases and judging: ``bench/campaigns/damage.py``).

The fixtures are built once. A worker process runs the cases one after another in process
(``zaya_jax.cli.main(argv)``, exactly what the ``zaya`` script runs, and the Python API), so one
interpreter and one compilation cache serve them all; for each it copies the input fresh, damages
it, hashes it, runs the command with stdout and stderr captured, hashes it again and appends the
outcome to ``results.jsonl``. The parent (:func:`run_campaign`) reads that file as it grows: a case
with no result after ``timeout`` seconds is a hang (the worker is killed), a worker that dies is a
crash of that case (counted as a traceback), and a new worker goes on with the next case.

    python -m bench.campaigns.damage_runner worker --root DIR --start K   (started by run_campaign)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import io
import json
import random
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import campaigns
from bench.campaigns.corruptions import GOOD_REWARD
from bench.campaigns.damage import (
    KINDS,
    Case,
    Outcome,
    apply_damage,
    judge,
    lost_entries,
    plan,
    restore_permissions,
    snapshot,
)

REPO = Path(__file__).resolve().parents[2]
MINI_MODEL = campaigns.MINI_MODEL
MINI = [*campaigns.MINI, "log.every=2", "eval.every=3", "--no-progress"]
RUN = [*MINI, "train.steps=4", "checkpoint.every_steps=2", "eval.every=100"]
SMALL_EVAL = ["--seq-len", "64", "--batch-size", "2", "--batches", "1"]
# Post-training: chat and preference runs on rows of 128 byte tokens, GRPO on 2 groups of 2 completions.
POST = [*MINI_MODEL, "--no-progress", "model.vocab_size=264", "train.batch_size=2", "train.seq_len=128"]
POST += ["eval.batches=1", "eval.every=100", "log.every=1", "optim.warmup_steps=1", "train.steps=1"]
GRPO = [*MINI_MODEL, "--no-progress", "model.vocab_size=264", "train.objective=grpo", "train.batch_size=4"]
GRPO += ["train.seq_len=64", "rl.group_size=2", "rl.max_new_tokens=4", "rl.eval_prompts=2", "train.steps=1"]
GRPO += ["eval.every=100", "optim.warmup_steps=1"]
REWARD = "rl.reward=zr_reward:score"


def _pairs_run(pairs: Path, objective: str, run: Path) -> list[str]:
    """``zaya train`` of a 2-step preference run on ``pairs``, saving every step (the fixtures'
    dpo and simpo runs, and their resumption)."""
    source = f"data.sources=[{{name: pairs, kind: preference, path: {pairs}}}]"
    return ["train", "dpo", *POST, source, f"train.objective={objective}", "data.held_out_fraction=0.25",
            "checkpoint.every_steps=1", "train.steps=2", f"run.dir={run}"]  # fmt: skip


def _rollout_records(count: int, seed: int) -> list[dict[str, Any]]:
    """Rollout file records (``rl.rollouts``): ``count`` completions in groups of 2."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        n = rng.randrange(2, 5)
        records.append(
            {
                "group": i // 2,
                "prompt_ids": [rng.randrange(3, 259) for _ in range(rng.randrange(3, 8))],
                "completion_ids": [rng.randrange(3, 259) for _ in range(n)],
                "logprobs": [round(-rng.random() * 4, 4) for _ in range(n)],
                "reward": float(rng.randrange(3)),
            }
        )
    return records


def build_post_training_fixtures(fixtures: Path) -> None:
    """The post-training inputs: chat, preference, prompt and rollout files, a reward module, and a
    dpo, a simpo and a GRPO run (2, 2 and 1 steps) trained on them."""
    from zaya_jax.cli import main
    from zaya_jax.data.tasks import reverse_chats, reverse_pairs, write_jsonl

    write_jsonl(fixtures / "chat.jsonl", reverse_chats(16, seed=4))
    write_jsonl(fixtures / "pairs.jsonl", reverse_pairs(16, seed=4))
    write_jsonl(fixtures / "prompts.jsonl", reverse_chats(16, seed=5))
    write_jsonl(fixtures / "rollouts.jsonl", _rollout_records(8, seed=6))
    (fixtures / "reward").mkdir()
    (fixtures / "reward" / "zr_reward.py").write_text(GOOD_REWARD)
    for objective in ("dpo", "simpo"):
        _ok(main(_pairs_run(fixtures / "pairs.jsonl", objective, fixtures / f"{objective}_run")), objective)
    with reward_module(fixtures / "reward"):
        _ok(main(["train", *GRPO, REWARD, f"run.dir={fixtures / 'grpo_run'}"]), "the GRPO run")


@contextlib.contextmanager
def reward_module(directory: Path) -> Iterator[None]:
    """``directory`` importable (as ``PYTHONPATH=directory``) and ``zr_reward`` imported afresh from
    it, as in a new process."""
    sys.modules.pop("zr_reward", None)
    importlib.invalidate_caches()
    sys.path.insert(0, str(directory))
    try:
        yield
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop("zr_reward", None)


def build_fixtures(fixtures: Path) -> None:
    """The pristine inputs: a 4-step run saved at steps 2 and 4, its HF export with a BPE tokenizer,
    the same weights as a sharded HF directory, a JSONL corpus and its prepared directory, a YAML
    config, and a garbage file for symlinks to point at."""
    from tokenizers import ByteLevelBPETokenizer

    from zaya_jax import load
    from zaya_jax.cli import main
    from zaya_jax.data.tasks import write_jsonl
    from zaya_jax.interop.hf import save_hf_directory

    if (fixtures / "complete").is_file():
        return
    shutil.rmtree(fixtures, ignore_errors=True)
    fixtures.mkdir(parents=True)
    _ok(main(["train", *RUN, f"run.dir={fixtures / 'run'}"]), "the fixture run")
    _ok(main(["convert", "zaya-to-hf", str(fixtures / "run"), str(fixtures / "hf")]), "the HF export")
    # a byte-level BPE of 264 entries (<pad>, </s>, <s>, the 256 bytes, 5 merges), no post-processor
    tokenizer, words = ByteLevelBPETokenizer(), ["hello world", "héllo wörld", "the quick brown fox"]
    tokenizer.train_from_iterator(
        words * 10, 264, special_tokens=["<pad>", "</s>", "<s>"], show_progress=False
    )
    tokenizer.post_processor = None
    tokenizer.save(str(fixtures / "hf" / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (fixtures / "hf" / "tokenizer_config.json").write_text(json.dumps(special, indent=2))
    lm = load(fixtures / "run")
    save_hf_directory(fixtures / "hf_sharded", lm.config, lm.variables, max_shard_bytes=40_000)
    texts = [f"document {i}: the quick brown fox jumps over " + "lorem ipsum " * (i % 5) for i in range(64)]
    write_jsonl(fixtures / "corpus.jsonl", [{"text": text} for text in texts])
    prepared = ["data", "prepare", str(fixtures / "corpus.jsonl"), "--out", str(fixtures / "prepared")]
    _ok(main([*prepared, "--shards", "2"]), "the prepared directory")
    config = {
        "inherits": "tiny",
        "model": campaigns.MODEL,
        "train": {"steps": 1, "batch_size": 2, "seq_len": 32},
    }
    (fixtures / "config.yaml").write_text(json.dumps({**config, "eval": {"batches": 1}}, indent=2))
    (fixtures / "outside").mkdir()
    (fixtures / "outside" / "garbage.bin").write_bytes(bytes(range(256)) * 64)
    build_post_training_fixtures(fixtures)
    (fixtures / "complete").write_text("")


def _ok(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"building {what} failed with exit {code}")


def command(case: Case, given: Path, out: Path, fixtures: Path) -> list[str] | Callable[[], Any]:
    """The argv of ``zaya`` (or a Python call) that reads ``given`` for ``case.command``."""
    tokenizer = (
        [] if (fixtures / KINDS[case.kind].source / "tokenizer.json").exists() else ["--tokenizer", "byte"]
    )
    on_hf = case.kind in ("hf", "hf_sharded", "tokenizer")
    train_out = [f"run.dir={out}"]
    argv = {
        "eval": ["eval", str(given), *((SMALL_EVAL + tokenizer) if on_hf else [])],
        "generate": ["generate", str(given), "--prompt", "hello", "--max-new-tokens", "3", *tokenizer],
        "inspect": ["inspect", str(given)],
        "to_hf": ["convert", "zaya-to-hf", str(given), str(out)],
        "to_zaya": ["convert", "hf-to-zaya", str(given), str(out)],
        "init_from": ["train", *MINI, "train.steps=1", f"train.init_from={given}", *train_out],
        "resume": ["train", *RUN, "train.steps=5", f"run.dir={given}"],
        "prepare_with": [
            "data",
            "prepare",
            str(fixtures / "corpus.jsonl"),
            "--out",
            str(out),
            "--tokenizer",
            str(given / "tokenizer.json"),
            "--shards",
            "1",
        ],
        "prepare": ["data", "prepare", str(given), "--out", str(out), "--shards", "1"],
        "inspect_rows": ["inspect", str(given), "--rows", "2"],
        "train_on": [
            "train",
            *MINI,
            "train.steps=1",
            f"data.sources=[{{name: p, kind: arrayrecord, path: {given}}}]",
            *train_out,
        ],
        "train_config": ["train", "--config", str(given), *train_out],
        "inspect_config": ["inspect", "--config", str(given)],
        "train_override": ["train", *MINI, "train.steps=1", case.target, *train_out],
        "inspect_override": ["inspect", "--config", "tiny", case.target],
        **_post_training_commands(case, given, out, fixtures),
    }
    if case.command == "load":
        from zaya_jax import load

        return lambda: load(given)
    if case.command == "harness":
        from zaya_jax.harness import ZayaLM

        return lambda: ZayaLM(str(given))
    return argv[case.command]


def _post_training_commands(case: Case, given: Path, out: Path, fixtures: Path) -> dict[str, list[str]]:
    train_out = [f"run.dir={out}"]
    pairs = f"data.sources=[{{name: pairs, kind: preference, path: {given}}}]"
    dpo = ["train", "dpo", *POST, pairs, "data.held_out_fraction=0.25", *train_out]
    sft = ["train", *POST, f"data.sources=[{{name: chat, kind: chat, path: {given}}}]", *train_out]
    sft += ["data.held_out_fraction=0.25"]
    fixture_pairs = fixtures / "pairs.jsonl"
    return {
        "sft": sft,
        "sft_skip": [*sft, "data.on_bad_document=skip"],
        "prepare_chat": [
            "data",
            "prepare",
            str(given),
            "--out",
            str(out),
            "--shards",
            "1",
            "--format",
            "chat",
        ],
        "dpo": dpo,
        "simpo": [*dpo, "train.objective=simpo"],
        "eval_pairs": ["eval", str(fixtures / "dpo_run"), "--data", str(given)],
        "eval_pairs_of_run": ["eval", str(given), "--data", str(fixture_pairs)],
        "grpo_prompts": ["train", *GRPO, f"rl.prompts={given}", "data.held_out_fraction=0.25", *train_out],
        # the fixture's log-probabilities are random numbers, not a sampler's: with the sampler_gap
        # bound off, the damage alone decides the outcome
        "grpo_rollouts": ["train", *GRPO, f"rl.rollouts={given}", "rl.max_sampler_gap=0", *train_out],
        "grpo": ["train", *GRPO, REWARD, *train_out],
        "grpo_skip": ["train", *GRPO, REWARD, "rl.on_reward_error=skip", *train_out],
        "eval_grpo": ["eval", str(fixtures / "grpo_run")],
        "resume_dpo": [*_pairs_run(fixture_pairs, "dpo", given), "train.steps=3"],
        "resume_simpo": [*_pairs_run(fixture_pairs, "simpo", given), "train.steps=3"],
        "grpo_override": ["train", *GRPO, case.target, *train_out],
        "dpo_override": [*_pairs_run(fixture_pairs, "dpo", out), "train.steps=1", case.target],
        "simpo_override": [*_pairs_run(fixture_pairs, "simpo", out), "train.steps=1", case.target],
    }


def invoke(call: list[str] | Callable[[], Any]) -> tuple[int | None, str, str, str | None]:
    """(exit code, stderr, the error line, the traceback of an exception that escaped) of one
    command, in process. The error line is the last ``zaya CMD:`` line that is not a warning; for
    the Python API, its documented errors (not found, corrupt, a bad value, a storage error) count
    as exit 1 with their message, any other exception escapes."""
    from zaya_jax.checkpoint import CheckpointCorruptError
    from zaya_jax.cli import main

    err = io.StringIO()
    code: int | None = None
    line, escaped = "", None
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("always")
        for category in (ResourceWarning, DeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        try:
            if callable(call):
                try:
                    call()
                    code = 0
                except (ValueError, OSError, CheckpointCorruptError) as error:
                    code, line = 1, f"{type(error).__name__}: {error}"
            else:
                code = main(call)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
            line = "" if isinstance(exit_.code, int | None) else str(exit_.code)
        except BaseException:  # whatever escapes is what the campaign counts
            escaped = traceback.format_exc()
        gc.collect()  # what the command left behind prints here (at exit in a real run), not in a later case
    stderr = err.getvalue()
    if not line:
        errors = [x for x in stderr.splitlines() if x.startswith("zaya ") and ": warning:" not in x]
        line = errors[-1] if errors else (stderr.strip().splitlines() or [""])[-1]
    return code, stderr, line, escaped


def run_case(case: Case, root: Path, keep: bool = False) -> Outcome:
    kind = KINDS[case.kind]
    fixtures = root / "fixtures"
    case_dir = root / "cases" / str(case.index)
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    copy, given, damaged = None, Path(case.target), []
    if kind.source:
        source = fixtures / kind.source
        copy = case_dir / source.name
        shutil.copytree(source, copy, symlinks=True) if source.is_dir() else shutil.copy(source, copy)
        given = copy / kind.given if kind.given else copy
        damaged = apply_damage(case, copy, case_dir, fixtures / "outside" / "garbage.bin")
    before = snapshot(copy) if copy else {}
    started = time.perf_counter()
    # A reward module is imported from the case's copy (rl.reward=zr_reward:score), as in a new process.
    importable = reward_module(copy) if case.kind == "reward" else contextlib.nullcontext()
    with importable:
        code, stderr, line, escaped = invoke(command(case, given, case_dir / "out", fixtures))
    seconds = time.perf_counter() - started
    after = snapshot(copy) if copy else {}
    modified = lost_entries(before, after, training=case.command.startswith("resume"))
    result, line = judge(case, code, stderr, line, escaped, damaged, given)
    if copy is not None:
        restore_permissions(case_dir)
    if not keep and result not in ("unclear", "traceback") and not modified:
        shutil.rmtree(case_dir, ignore_errors=True)
    return Outcome(case, result, modified, code, (escaped or line)[-2000:], round(seconds, 2))


def _worker(root: Path, start: int, keep: bool) -> None:
    sys.dont_write_bytecode = True  # no __pycache__ next to a case's reward module
    build_fixtures(root / "fixtures")
    cases = [Case(**c) for c in json.loads((root / "plan.json").read_text())]
    with (root / "results.jsonl").open("a") as results:
        for case in cases[start:]:
            results.write(json.dumps({"started": case.index}) + "\n")
            results.flush()
            results.write(json.dumps(run_case(case, root, keep).to_json()) + "\n")
            results.flush()


def run_campaign(
    root: Path,
    cases: list[Case],
    *,
    timeout: float = 300.0,
    fixture_timeout: float = 900.0,
    keep: bool = False,
    log: Callable[[str], None] = print,
) -> list[Outcome]:
    """Run ``cases`` (from :func:`~bench.campaigns.damage.plan`) in worker processes; returns their
    outcomes in order, hangs and crashed workers included."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "plan.json").write_text(json.dumps([dataclasses.asdict(c) for c in cases]))
    results = root / "results.jsonl"
    results.unlink(missing_ok=True)
    outcomes: dict[int, Outcome] = {}
    start = 0
    while start < len(cases):
        current = _supervise_worker(root, start, timeout, fixture_timeout, keep, outcomes, log)
        if current is None:
            raise RuntimeError(
                f"the campaign's worker failed before its first case; see {root / 'worker.log'}"
            )
        start = current + 1
    return [outcomes[c.index] for c in cases]


def _supervise_worker(
    root: Path,
    start: int,
    timeout: float,
    fixture_timeout: float,
    keep: bool,
    outcomes: dict[int, Outcome],
    log: Callable[[str], None],
) -> int | None:
    """One worker from case ``start``; returns the index of the last case it started (None: none)."""
    cases = {c["index"]: Case(**c) for c in json.loads((root / "plan.json").read_text())}
    argv = [
        sys.executable,
        "-m",
        "bench.campaigns.damage_runner",
        "worker",
        "--root",
        str(root),
        "--start",
        str(start),
    ]
    argv += ["--keep"] if keep else []
    results = root / "results.jsonl"
    offset = results.stat().st_size if results.exists() else 0
    with (root / "worker.log").open("a") as worker_log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=worker_log, stderr=subprocess.STDOUT)
    current, last, budget, killed = None, time.monotonic(), fixture_timeout, False
    while True:
        finished = proc.poll() is not None
        if results.exists():
            with results.open() as f:
                f.seek(offset)
                lines = f.readlines()
                offset = f.tell() if lines and lines[-1].endswith("\n") else offset
            for line in (x for x in lines if x.endswith("\n")):
                record = json.loads(line)
                if "started" in record:
                    current, last, budget = record["started"], time.monotonic(), timeout
                else:
                    outcome = Outcome(**{**record, "case": Case(**record["case"])})
                    outcomes[outcome.case.index] = outcome
                    log(
                        f"{outcome.case.describe()}: {outcome.result} {'MODIFIED ' if outcome.modified else ''}{outcome.message[:160]}"
                    )
        if finished:
            break
        if time.monotonic() - last > budget:
            proc.kill()
            proc.wait()
            killed = True
            break
        time.sleep(0.2)
    if current is not None and current not in outcomes:
        result = "hang" if killed else "traceback"
        tail = (root / "worker.log").read_text()[-1500:]
        outcomes[current] = Outcome(
            cases[current], result, [], proc.returncode, tail, round(time.monotonic() - last, 1)
        )
        log(f"{cases[current].describe()}: {result} (worker exit {proc.returncode})")
    return current


RESULTS = ("fallback", "clear", "unaffected", "unclear", "traceback", "hang")


def table(outcomes: list[Outcome]) -> str:
    """Markdown: cases per input kind and what they ended in."""
    head = "| input | cases | fallback | clear error | unaffected | unclear error | traceback | hang | modified inputs |"
    rows = [head, "|" + "---|" * 9]
    groups = {kind: [o for o in outcomes if o.case.kind == kind] for kind in KINDS}
    groups["**all**"] = outcomes
    for kind, group in groups.items():
        if group:
            counts = [sum(o.result == r for o in group) for r in RESULTS]
            rows.append(
                f"| {kind} | {len(group)} | "
                + " | ".join(map(str, counts))
                + f" | {sum(bool(o.modified) for o in group)} |"
            )
    return "\n".join(rows)


def failures(outcomes: list[Outcome]) -> list[str]:
    return [
        f"{o.case.describe()}: {o.result}{' modified ' + str(o.modified[:5]) if o.modified else ''}: {o.message[-600:]}"
        for o in outcomes
        if o.result in ("unclear", "traceback", "hang") or o.modified
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["worker"])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    _worker(args.root, args.start, args.keep)


if __name__ == "__main__":
    main()


__all__ = ["build_fixtures", "failures", "plan", "run_campaign", "table"]
