"""The host-side gap between training steps, read from a ``jax.profiler`` trace of ``zaya train``.

Each variant (a list of ``key=value`` overrides, e.g. ``train.dispatch_ahead=false``) trains the
``tiny`` preset at a small batch, where the host's share of a step is largest, in its own process;
the variants alternate over ``--rounds`` rounds. The profile window (``profile.steps``) covers
steady-state steps only (after compilation and the first log record). From the trace, each train
step's execution is the XLA:CPU program run (``ThunkExecutor::Execute (wait for completion)``, the
longest spans); the gap is the time from one step's execution end to the next one's start, during
which the device has nothing to run. Reported per variant: the median gap, the device-idle share of
the window (gaps / span) and steps/s over the window, best round by idle share. Prints one JSON object.

    python bench/dispatch_gap.py [--rounds 3] [--steps 60] [--batch 2] [--seq 64] \
        [--variant sync train.dispatch_ahead=false] [--variant ahead train.dispatch_ahead=true]
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STEP_SPAN = "ThunkExecutor::Execute (wait for completion)"


def step_spans(trace_file: Path) -> list[tuple[float, float]]:
    """(start, end) in µs of each train step's execution in the trace, in order."""
    with gzip.open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    spans = [
        (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("name") == STEP_SPAN
    ]
    if not spans:
        raise SystemExit(f"{trace_file} holds no '{STEP_SPAN}' events")
    longest = max(end - start for start, end in spans)
    return sorted(s for s in spans if s[1] - s[0] >= 0.5 * longest)  # the train step, not small programs


def gap_stats(spans: list[tuple[float, float]]) -> dict[str, float]:
    gaps = [max(0.0, b[0] - a[1]) for a, b in itertools.pairwise(spans)]
    span = spans[-1][1] - spans[0][0]
    return {
        "steps": len(spans),
        "median_gap_ms": round(statistics.median(gaps) / 1e3, 3),
        "idle_share": round(sum(gaps) / span, 4),
        "median_step_ms": round(statistics.median(b - a for a, b in spans) / 1e3, 3),
        "steps_per_s": round((len(spans) - 1) / (spans[-1][0] - spans[0][0]) * 1e6, 2),
    }


def run_variant(overrides: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    run = Path(tempfile.mkdtemp(dir=workdir)) / "run"
    first = max(args.steps // 3, 12)
    command = [
        sys.executable, "-m", "zaya_jax.cli", "train", "--config", "tiny", f"run.dir={run}", "--no-progress",
        f"train.steps={args.steps}", f"train.batch_size={args.batch}", f"train.seq_len={args.seq}",
        "eval.every=100000", "log.every=10", "checkpoint.every_steps=0", f"profile.steps=[{first},{args.steps - 2}]",
        *overrides,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    traces = sorted((run / "profile").rglob("*.trace.json.gz"))
    return gap_stats(step_spans(traces[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "OVERRIDE"))
    args = parser.parse_args()
    variants = {
        v[0]: v[1:]
        for v in args.variant
        or [["sync", "train.dispatch_ahead=false"], ["ahead", "train.dispatch_ahead=true"]]
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as workdir:
        for round_ in range(args.rounds):
            for name, overrides in variants.items():
                results[name].append(run_variant(overrides, args, Path(workdir)))
                print(f"round {round_} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    best = {name: min(rounds, key=lambda r: r["idle_share"]) for name, rounds in results.items()}
    print(
        json.dumps(
            {"shape": [args.batch, args.seq], "steps": args.steps, "best": best, "rounds": results}, indent=2
        )
    )


if __name__ == "__main__":
    main()
