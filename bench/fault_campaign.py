"""Randomized SIGKILL fault campaign (issue 18, item 4): ``zaya train``, ``zaya data prepare`` and
``zaya convert`` (both directions) killed at seeded random moments, then resumed or rerun; every
result must equal the uninterrupted one and nothing committed may be lost. The trial logic, the
kill moments and the definition of "lost" are in bench/campaigns/sigkill.py (its docstring); the
CI runs a short subset of it (tests/resilience/test_campaign.py). Usage:

    python bench/fault_campaign.py --seed 0 --kills 30 [--kills-per-trial 1] [--prepare-kills 10]
        [--convert-kills 10] [--steps 12] [--documents 150000] [--convert-model larger|mini]
        [--dir DIR] [--keep] [--parallel]

``--kills N``: N SIGKILLs that hit a live process (a drawn moment that comes after the process has
finished is counted as missed and the next one drawn). A warm-up run fills the compilation cache
first, so the reference's timeline (from which the kill moments are scaled) is that of a restart.

Prints the table (markdown, for bench/RESULTS.md) and every failed check; exits 1 when a check
failed. The same seed draws the same kill moments (where they land also depends on the machine's
timing, which the "where the kills landed" lines record).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.campaigns

from bench.campaigns.sigkill import LARGER_MODEL, MINI_MODEL, run_campaign, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kills", type=int, default=30, help="SIGKILLs of zaya train")
    parser.add_argument(
        "--kills-per-trial", type=int, default=1, help="kills of one run before it may finish"
    )
    parser.add_argument("--prepare-kills", type=int, default=10, help="SIGKILLs of zaya data prepare")
    parser.add_argument("--convert-kills", type=int, default=10, help="SIGKILLs of zaya convert, each way")
    parser.add_argument("--steps", type=int, default=12, help="training steps (one async checkpoint each)")
    parser.add_argument("--documents", type=int, default=150_000, help="documents of the prepare corpus")
    parser.add_argument(
        "--convert-model",
        choices=["larger", "mini"],
        default="larger",
        help="the model converted: 26M parameters (default; writing it takes long enough to be hit) or MINI",
    )
    parser.add_argument("--dir", default=None, help="working directory (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the trials that passed too")
    parser.add_argument("--parallel", action="store_true", help="run train beside prepare/convert")
    args = parser.parse_args()

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zaya-fault-campaign-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    print(f"fault campaign in {root}", file=sys.stderr)
    tallies = run_campaign(
        root,
        seed=args.seed,
        train_kills=args.kills,
        kills_per_trial=args.kills_per_trial,
        prepare_kills=args.prepare_kills,
        convert_kills=args.convert_kills,
        steps=args.steps,
        corpus_documents=args.documents,
        convert_model=LARGER_MODEL if args.convert_model == "larger" else MINI_MODEL,
        warmup=True,
        parallel=args.parallel,
        keep_outputs=args.keep,
    )
    minutes = (time.time() - started) / 60
    print(f"{datetime.date.today()}: python bench/fault_campaign.py {shlex.join(sys.argv[1:])}")
    print(f"seed {args.seed}, {minutes:.1f} min\n")
    print(table(tallies))
    failures = [f for t in tallies for f in t.failures]
    for failure in failures:
        print(f"\nFAILED: {failure}")
    return 1 if failures or not all(t.ok for t in tallies) else 0


if __name__ == "__main__":
    sys.exit(main())
