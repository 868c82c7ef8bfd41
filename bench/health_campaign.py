"""The node-health fault campaign (issue 54): a GPU reporting uncorrectable ECC errors, a NIC going
down, the run's filesystem filling up, a collective that never returns, each injected into a run of
two processes, and a SIGKILL during local-tier saves and a node lost with its local tier (one
process); for each the action taken, the seconds from injection to action (goal <= 60 s), the
steps lost and the run's goodput over both launches. The trials are in bench/campaigns/health.py
(its docstring); CI runs the drain across two processes (tests/parallel/test_multiprocess.py) and
the Slurm requeue (tests/resilience/test_supervise.py). Usage:

    python bench/health_campaign.py [--steps 30] [--every 10] [--dir DIR] [--only FAULT ...]

Prints the table (markdown, for bench/RESULTS.md); exits 1 when a fault was silent or not acted on.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.campaigns

from bench.campaigns.health import run_trial, table

# fault -> injected after this step (the persistent tier saves every 10 steps)
FAULTS = {
    "gpu_ecc": 4, "nic_down": 4, "filesystem_low": 4, "filesystem_full": 12, "collective_hang": 12,
    "local_save_killed": 15, "node_lost": 15,
}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=float, default=10.0, help="resilience.health_every_s")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--only", nargs="*", choices=sorted(FAULTS), default=None)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="zaya-health-campaign-"))
    trials = []
    for fault, after in FAULTS.items():
        if args.only and fault not in args.only:
            continue
        print(f"{fault}...", file=sys.stderr, flush=True)
        trials.append(run_trial(fault, root, args.steps, after, args.every))
        print(f"  {trials[-1]}", file=sys.stderr, flush=True)
    print(table(trials, args.every))
    failed = [t for t in trials if not t.note.startswith("not run") and (t.silent or t.note)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
