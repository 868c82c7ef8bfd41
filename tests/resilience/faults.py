"""Fault injection for tests, through the loop's hook interface (``train(cfg, hooks=[...])``):
nothing here is built in a user's run.

Run ``zaya`` with faults as a child process (the faults that kill or hang the process need one)::

    python -m tests.resilience.faults --fault crash_at_step=5 [--fault ...] train <zaya train args>

Faults (``--fault NAME=STEP``): ``crash_at_step`` (SIGKILL right after the step),
``crash_during_save_at_step`` (SIGKILL while that step's checkpoint is being written),
``nan_at_step`` (the step's host batch gets a NaN loss mask: the loss guard must catch it),
``hang_at_step`` (no progress after the step: the hang watchdog must catch it),
``corrupt_checkpoint_at_step`` (that step's committed checkpoint overwritten with garbage).
``--clock-skew S`` runs the ``checkpoint.every_minutes`` clock of every process but process 0
``S`` seconds ahead. Every fault fires at most once per run directory (``faults_fired.json``
records it), so a restarted run gets past it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from zaya_jax.files import write_atomic
from zaya_jax.train.hooks import Hook, RunContext, StepEnd

FIRED = "faults_fired.json"
FAULTS = (
    "crash_at_step",
    "crash_during_save_at_step",
    "nan_at_step",
    "hang_at_step",
    "corrupt_checkpoint_at_step",
)


def corrupt_checkpoint(step_dir: Path) -> list[str]:
    """Overwrite every file of a committed checkpoint's training state with garbage of the same
    size (what a failing disk or an interrupted copy leaves); returns the files touched."""
    touched = []
    for path in sorted((step_dir / "train").rglob("*")):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(b"\xa5" * path.stat().st_size)
            touched.append(str(path.relative_to(step_dir)))
    return touched


def hang() -> None:
    while True:  # the watchdog ends the process
        time.sleep(3600)


class FaultHook(Hook):
    """The faults ``at`` (name -> step), each fired once per run directory."""

    def __init__(self, at: dict[str, int]):
        unknown = sorted(set(at) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {FAULTS}")
        self.at = at

    def start(self, run: RunContext) -> None:
        self.run, self.checkpoints, self.primary = run.run, run.checkpoints, run.primary
        self.path = run.run.path / FIRED
        self.fired = set(json.loads(self.path.read_text())) if self.path.is_file() else set()

    def due(self, name: str, step: int) -> bool:
        """Whether fault ``name`` is set for ``step`` and has not fired yet; marks it fired (on
        disk, before it acts)."""
        if self.at.get(name) != step or name in self.fired:
            return False
        self.fired.add(name)
        if self.primary:
            write_atomic(self.path, json.dumps(sorted(self.fired)))
        return True

    def before_step(self, step: int, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.due("nan_at_step", step):
            return {**batch, "loss_mask": batch["loss_mask"] * np.float32(math.nan)}
        return batch

    def after_step(self, end: StepEnd) -> None:
        step, saved = end.step, self.checkpoints.saved_step == end.step
        if saved and self.due("crash_during_save_at_step", step):
            os.kill(os.getpid(), signal.SIGKILL)  # the save is still being written in the background
        if saved and self.due("corrupt_checkpoint_at_step", step):
            self.checkpoints.saver.finish()
            corrupt_checkpoint(self.run.checkpoints / str(step))
        if self.due("crash_at_step", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.due("hang_at_step", step):
            hang()


class SkewedSaveClock(Hook):
    """The ``checkpoint.every_minutes`` clock of every process but process 0 runs ``seconds``
    ahead (a time-based save due by one process's clock only)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def start(self, run: RunContext) -> None:
        if jax.process_index() > 0:
            run.checkpoints.clock = lambda: time.monotonic() + self.seconds


def _parse(argv: list[str]) -> tuple[list[Hook], list[str]]:
    parser = argparse.ArgumentParser(prog="python -m tests.resilience.faults")
    parser.add_argument("--fault", action="append", default=[], metavar="NAME=STEP")
    parser.add_argument("--clock-skew", type=float, default=0.0, metavar="SECONDS")
    args, rest = parser.parse_known_args(argv)
    at = {name: int(step) for name, step in (text.split("=", 1) for text in args.fault)}
    hooks: list[Hook] = [FaultHook(at)] if at else []
    if args.clock_skew:
        hooks.append(SkewedSaveClock(args.clock_skew))
    return hooks, rest


def command(*faults: str, clock_skew: float = 0.0) -> list[str]:
    """The command prefix that runs ``zaya`` with ``faults`` ("NAME=STEP"): append ``train ...``."""
    cmd = [sys.executable, "-m", "tests.resilience.faults"]
    for fault in faults:
        cmd += ["--fault", fault]
    return cmd + (["--clock-skew", str(clock_skew)] if clock_skew else [])


if __name__ == "__main__":
    from zaya_jax.cli import main

    fault_hooks, zaya_argv = _parse(sys.argv[1:])
    sys.exit(main(zaya_argv, hooks=fault_hooks))
