"""The damaged-input campaign (issue 25, item 3): a seeded generator damages every kind of input the
commands read (run and step directories with their Orbax items, metadata, OCDBT files and
fingerprints, HF directories with safetensors, index files and tokenizers, prepared data, a corpus,
configs and overrides) in many ways and runs every command that reads it; each case must end in a
clear one-line error naming the path (exit 1 or 2), in the documented fallback (a checkpoint set
aside, the previous one used) or unaffected, never in a traceback or a hang, and must leave the
user's files as they were. Cases, damage and judging: bench/campaigns/damage.py; running them:
bench/campaigns/damage_runner.py; the CI runs a seeded subset (tests/resilience/test_damaged_inputs.py).

    python bench/damaged_inputs.py --seed 0 --cases 240 [--kinds run,step,...] [--dir DIR] [--keep]
    python bench/damaged_inputs.py --post-training --seed 0 --cases 240

The second form damages the post-training inputs (chat, preference, prompt and rollout files, a
reward module, a dpo and a simpo run with their reference scores, the rl and preference keys) and
runs the commands that read them (SFT, dpo and simpo training and resumption, GRPO with a reward
module, prompts or rollout files, eval of preference and GRPO runs, eval --data of pairs).

Prints one line per case, then the table (markdown, for bench/RESULTS.md) and every failed case;
exits 1 when a case failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.campaigns

from bench.campaigns.damage import POST_TRAINING, PRETRAINING, plan
from bench.campaigns.damage_runner import failures, run_campaign, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=240)
    parser.add_argument(
        "--kinds",
        default=",".join(PRETRAINING),
        help="input kinds, comma-separated (default: the pretraining ones)",
    )
    parser.add_argument(
        "--post-training",
        action="store_true",
        help=f"the post-training inputs and commands instead ({', '.join(POST_TRAINING)})",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a case may take before it is a hang"
    )
    parser.add_argument("--dir", default=None, help="working directory (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep every case's directory")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zaya-damage-"))
    kinds = POST_TRAINING if args.post_training else tuple(args.kinds.split(","))
    cases = plan(args.seed, args.cases, kinds)
    print(f"{len(cases)} cases in {root}", file=sys.stderr)
    started = time.time()
    outcomes = run_campaign(
        root, cases, timeout=args.timeout, keep=args.keep, log=lambda s: print(s, file=sys.stderr, flush=True)
    )
    print(f"\nseed {args.seed}, {len(outcomes)} cases, {time.time() - started:.0f} s\n")
    print(table(outcomes))
    bad = failures(outcomes)
    for line in bad:
        print(f"- {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
