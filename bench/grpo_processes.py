"""GRPO steps/s and the share of each step spent sampling, on one process and on two.

The ``grpo`` preset (``tiny`` model, 8 prompts x 8 completions of up to 16 tokens per step, the
rollout engine sampling, router replay) from its random init, ``--steps`` steps, on a mesh of 2 data
devices either way: one process holding both (2 CPU devices, every core), or two processes of one
device each (``jax.distributed`` on this host, each pinned to its own core with ``taskset``), each
sampling half of every rollout's rows and gathering the rest. From ``metrics.jsonl`` (logged every
step): a step's seconds are its tokens over ``tokens_per_s``, its sampling seconds the producer's
``data_wait_s`` (GRPO samples on policy, nothing is prefetched); the first two steps (compilation)
and the last (the final evaluation) are left out.

    python bench/grpo_processes.py [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

BATCH, SEQ = 64, 64  # the grpo preset's batch (rows) and row length


def _command(run: Path, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "zaya_jax.cli", "train", "grpo", f"run.dir={run}", f"train.steps={steps}",
        "log.every=1", "eval.every=1000", "rl.eval_prompts=8", "checkpoint.every_steps=1000",
        "mesh.data=2", "--no-progress",
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(run: Path, steps: int) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    subprocess.run(_command(run, steps), check=True, env=env, capture_output=True, text=True)


def run_two(run: Path, steps: int) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                "taskset",
                "-c",
                str(i % os.cpu_count()),
                *_command(run, steps),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode:
            raise SystemExit(f"a process failed:\n{err[-3000:]}")


def measured(run: Path, steps: int) -> tuple[float, float]:
    """(steps/s, share of step time spent sampling) over steps 3 .. steps - 1."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in lines if "tokens_per_s" in r and 3 <= r["step"] < steps]
    seconds = [BATCH * SEQ / r["tokens_per_s"] for r in kept]
    waiting = [r["data_wait_s"] for r in kept]
    return len(seconds) / sum(seconds), sum(waiting) / sum(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"1 process": [], "2 processes": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, launch in (("1 process", run_one), ("2 processes", run_two)):
                run = Path(tmp) / f"{name.replace(' ', '_')}_{round_}"
                launch(run, args.steps)
                results[name].append(measured(run, args.steps))
                print(f"{name}: {results[name][-1][0]:.3f} steps/s", file=sys.stderr)
    print(
        f"grpo preset, {BATCH} rows x {SEQ} tokens per step, steps 3-{args.steps - 1}, best of {args.rounds}"
    )
    print("| processes | steps/s | sampling share of a step |")
    print("|---|---|---|")
    for name, values in results.items():
        rate, share = max(values)
        print(f"| {name} | {rate:.3f} | {share:.0%} |")


if __name__ == "__main__":
    main()
