"""Soak: does a long run's host memory stay flat?

Runs ``zaya train tiny`` (2,000 steps by default, a checkpoint every 200 and the preset's held-out
evaluations) as a child process and samples its resident set size (``VmRSS``) and the step it is at
(``heartbeat.json``) once a second. Reports the RSS when step ``--after`` is first reached, the RSS
at the end, the largest sample in between, and the growth from the first to the last (the issue's
bar: at most 5%). Not a timed test: it only reads memory.

    python bench/soak.py [--steps 2000] [--after 200] [--dir /tmp/zaya_soak]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def step_of(run: Path) -> int:
    try:
        return int(json.loads((run / "heartbeat.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--after", type=int, default=200, help="the step whose RSS is the baseline")
    parser.add_argument("--dir", default="/tmp/zaya_soak")
    args = parser.parse_args()
    run = Path(args.dir) / "run"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "zaya_jax.cli", "train", "tiny", f"train.steps={args.steps}",
           "checkpoint.every_steps=200", f"run.dir={run}", "--no-progress"]  # fmt: skip
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, int, float]] = []  # (seconds, step, RSS MiB)
    while proc.poll() is None:
        rss = rss_mib(proc.pid)
        if rss is not None:
            samples.append((time.time() - started, step_of(run), rss))
        time.sleep(1.0)
    err = proc.stderr.read()
    if proc.returncode != 0:
        print(err[-3000:], file=sys.stderr)
        return proc.returncode
    after = [s for s in samples if s[1] >= args.after]
    if not after:
        print(f"no sample at or after step {args.after}", file=sys.stderr)
        return 1
    base, end = after[0], after[-1]
    peak = max(s[2] for s in after)
    result = {
        "steps": args.steps,
        "wall_s": round(time.time() - started, 1),
        "baseline_step": base[1],
        "rss_at_baseline_mib": round(base[2], 1),
        "last_sampled_step": end[1],
        "rss_at_end_mib": round(end[2], 1),
        "peak_after_baseline_mib": round(peak, 1),
        "growth_pct": round(100 * (end[2] - base[2]) / base[2], 2),
        "peak_growth_pct": round(100 * (peak - base[2]) / base[2], 2),
        "samples": len(samples),
    }
    print(json.dumps(result, indent=2))
    (Path(args.dir) / "soak_samples.json").write_text(json.dumps(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
