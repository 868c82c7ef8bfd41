"""The ``tiny-recipe`` preset's curves: its three stages trained (``zaya train tiny-recipe``), then at
the last checkpoint of each stage the passkey accuracy at stage 1's length and at 4x it, and the
held-out loss by position at 4x (before the extension: the end of stage 2; after: the end of stage
3); the training loss and held-out loss by stage. Prints markdown tables and writes JSON.

    python bench/recipe.py --out /tmp/recipe               # trains, then evaluates (~10 min)
    python bench/recipe.py --out /tmp/recipe --skip-train  # evaluates a finished run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def zaya(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "zaya_jax.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"zaya {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def stage_ends(run: Path) -> list[int]:
    """The last step of every stage, from the run's metrics."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last: dict[int, int] = {}
    for r in records:
        if "loss" in r:
            last[r["stage"]] = r["step"]
    return [last[s] for s in sorted(last)]


def by_stage(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = []
    for stage in sorted({r["stage"] for r in records if "loss" in r}):
        steps = [r for r in records if "loss" in r and r["stage"] == stage]
        ends = {r["step"] for r in steps}
        evals = [r for r in records if "eval_loss" in r and r["step"] in ends]
        rows.append({
            "stage": stage + 1, "steps": f"{steps[0]['step']}-{steps[-1]['step']}", "seq_len": steps[0]["seq_len"],
            "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
            "eval_loss": evals[-1]["eval_loss"] if evals else None,
            "tokens_per_s": sorted(r["tokens_per_s"] for r in steps)[len(steps) // 2],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/tiny-recipe", help="the run directory")
    parser.add_argument("--skip-train", action="store_true", help="evaluate a finished run")
    parser.add_argument("--prompts", type=int, default=20, help="passkey checks per length and depth")
    args = parser.parse_args()
    run = Path(args.out)
    report: dict = {}
    if not args.skip_train:
        started = time.perf_counter()
        zaya("train", "tiny-recipe", f"run.dir={run}", "--no-progress")
        report["train_s"] = round(time.perf_counter() - started, 1)
    report["stages"] = by_stage(run)
    checks = {}
    for stage, step in enumerate(stage_ends(run), start=1):
        out = zaya("eval", str(run / "checkpoints" / str(step)), "--passkey", "128,512",
                   "--passkey-prompts", str(args.prompts), "--by-position", "4", "--seq-len", "512", "--json")  # fmt: skip
        checks[f"stage {stage} (step {step})"] = json.loads(out)
    report["checks"] = checks
    (run / "recipe_report.json").write_text(json.dumps(report, indent=2))

    print("| stage | steps | rows | first loss | last loss | held-out loss | tokens/s (median) |")
    print("|---|---|---|---|---|---|---|")
    for r in report["stages"]:
        held = "-" if r["eval_loss"] is None else f"{r['eval_loss']:.3f}"
        print(f"| {r['stage']} | {r['steps']} | {r['seq_len']} | {r['first_loss']:.3f} | {r['last_loss']:.3f} | "
              f"{held} | {r['tokens_per_s']:,.0f} |")  # fmt: skip
    print()
    print(
        "| checkpoint | passkey at 128 | passkey at 512 | held-out loss at positions 0-127 / 128-255 / 256-383 / 384-511 |"
    )
    print("|---|---|---|---|")
    for name, c in checks.items():
        p128, p512 = (x["accuracy"] for x in c["passkey"])
        spans = " / ".join(f"{b['loss']:.3f}" for b in c["loss"]["by_position"])
        print(f"| {name} | {p128:.0%} | {p512:.0%} | {spans} |")
    if "train_s" in report:
        print(f"\ntrained in {report['train_s']:.0f} s")


if __name__ == "__main__":
    main()
