"""Wall time of ``zaya`` commands with a cold and a warm persistent compilation cache.

Each command runs as a fresh process (as a user or a supervised restart runs it), first with an
empty cache directory (cold: every program compiles and is written to the cache), then again with
the same directory (warm: the programs are read back). The cold and warm runs of each command
alternate over ``--rounds`` rounds, each round with a new cache directory and new run directories,
so machine noise hits both alike; reported: the median wall time of each and their ratio.

    python bench/compile_cache.py [--rounds 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(args: list[str], cache_root: Path) -> float:
    """Wall time of ``zaya ARGS`` in a new process whose "auto" cache is ``cache_root/xla``."""
    env = {**os.environ, "ZAYA_CACHE_DIR": str(cache_root)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "zaya_jax.cli", *args], check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            source = root / "source"
            base = ["train", f"train.steps={args.steps}", "--no-progress"]
            commands = {  # RUN: a new run directory per invocation
                f"zaya train train.steps={args.steps}": [*base, "run.dir=RUN"],
                "zaya eval RUN": ["eval", str(source), "--json"],
                "zaya generate RUN": ["generate", str(source), "--prompt", "def ", "--max-new-tokens", "32"],
            }
            _run([*base, f"run.dir={source}"], root / "cache-source")  # the run eval and generate read
            for i, (name, argv) in enumerate(commands.items()):
                for kind in ("cold", "warm"):  # one cache per command: cold starts empty, warm reuses it
                    run_dir = root / f"run-{i}-{kind}"
                    command = [a.replace("RUN", str(run_dir)) if a == "run.dir=RUN" else a for a in argv]
                    elapsed = _run(command, root / f"cache-{i}")
                    times.setdefault(name, {}).setdefault(kind, []).append(elapsed)
    print(f"{'command':<32} {'cold s':>8} {'warm s':>8} {'warm/cold':>10}")
    for name, kinds in times.items():
        cold, warm = statistics.median(kinds["cold"]), statistics.median(kinds["warm"])
        print(f"{name:<32} {cold:8.1f} {warm:8.1f} {warm / cold:10.2f}")


if __name__ == "__main__":
    main()
