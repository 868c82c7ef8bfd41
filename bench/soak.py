"""Soak: does a long run's host memory stay flat?

Runs ``zaya train tiny`` (2,000 steps by default, a checkpoint every 200 and the preset's held-out
evaluations) as a child process and samples its resident set size (``VmRSS``) and the step it is at
(``heartbeat.json``) once a second. Reports the RSS when step ``--after`` is first reached, the RSS
at the end, the largest sample in between, and the growth from the first to the last (the issue's
bar: at most 5%). Not a timed test: it only reads memory.

    python bench/soak.py [--steps 2000] [--after 200] [--dir /tmp/zaya_soak]
    python bench/soak.py --analyze /tmp/zaya_soak/soak_samples.json   # the report again, no run

Besides the two end points it prints, per 200-step window, the median and the largest RSS, so a
slow climb (a leak) can be told from the allocator's swings around checkpoints and evaluations.
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
    parser.add_argument("--analyze", help="a soak_samples.json from an earlier run: report it, run nothing")
    args = parser.parse_args()
    if args.analyze:
        print(json.dumps(report(json.loads(Path(args.analyze).read_text()), args.after), indent=2))
        return 0
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
    (Path(args.dir) / "soak_samples.json").write_text(json.dumps(samples))
    result = report(samples, args.after)
    print(json.dumps({"steps": args.steps, "wall_s": round(time.time() - started, 1), **result}, indent=2))
    return 0


def report(samples: list[tuple[float, int, float]], after: int) -> dict:
    later = [s for s in samples if s[1] >= after]
    if not later:
        raise SystemExit(f"no sample at or after step {after}")
    base, end = later[0], later[-1]
    peak = max(s[2] for s in later)
    windows = {}
    for start in range(0, max(s[1] for s in samples) + 1, 200):
        values = sorted(s[2] for s in samples if start <= s[1] < start + 200)
        if values:
            windows[f"{start}-{start + 199}"] = {
                "median_mib": round(values[len(values) // 2]),
                "max_mib": round(values[-1]),
            }
    return {
        "baseline_step": base[1],
        "rss_at_baseline_mib": round(base[2], 1),
        "last_sampled_step": end[1],
        "rss_at_end_mib": round(end[2], 1),
        "growth_pct": round(100 * (end[2] - base[2]) / base[2], 2),
        "peak_after_baseline_mib": round(peak, 1),
        "peak_growth_pct": round(100 * (peak - base[2]) / base[2], 2),
        "samples": len(samples),
        "windows": windows,
    }


if __name__ == "__main__":
    sys.exit(main())
