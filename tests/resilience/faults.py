"""Fault injection for tests, through the loop's hook interface (``train(cfg, hooks=[...])``):
nothing here is built in a user's run.

Run ``zaya`` with faults as a child process (the faults that kill or hang the process need one)::

    python -m tests.resilience.faults --fault crash_at_step=5 [--fault ...] train <zaya train args>

Faults (``--fault NAME=STEP``): ``crash_at_step`` (SIGKILL right after the step),
``crash_during_save_at_step`` (SIGKILL while that step's checkpoint is being written),
``nan_at_step`` (the step's host batch gets a NaN loss mask: the loss guard must catch it),
``hang_at_step`` (no progress after the step: the hang watchdog must catch it),
``corrupt_checkpoint_at_step`` (that step's committed checkpoint overwritten with garbage),
``pause_at_step`` (the process waits after the step until the test releases it: :func:`pause`,
so that a signal or a file operation lands at a step the test chose, not at one a timer guessed),
``gpu_ecc_at_step`` (the last process's GPU reports uncorrectable ECC errors through the fake
``amd-smi`` of :func:`fake_amd_smi` from that step on; it returns once its health probe saw them),
``disk_full_at_step`` / ``disk_low_at_step`` (from that step on, every process's checkpoint
filesystems read as short of one checkpoint's room / as holding room for one and a half).
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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zaya_jax.files import write_atomic
from zaya_jax.train.hooks import Hook, RunContext, StepRecord

FIRED = "faults_fired.json"
FAULTS = (
    "crash_at_step",
    "crash_during_save_at_step",
    "nan_at_step",
    "hang_at_step",
    "corrupt_checkpoint_at_step",
    "pause_at_step",
    "gpu_ecc_at_step",
    "disk_full_at_step",
    "disk_low_at_step",
)

# A fake amd-smi: healthy, unless $ZAYA_FAKE_SMI/ecc-<the calling process's pid> exists, then two
# uncorrectable ECC errors on GPU 1 (fake_amd_smi puts it on a PATH; gpu_ecc_at_step makes the file).
_FAKE_AMD_SMI = """#!/bin/sh
errors=0
if [ -e "$ZAYA_FAKE_SMI/ecc-$PPID" ] || [ -e "$ZAYA_FAKE_SMI/ecc-all" ]; then errors=2; fi
case "$1" in
  metric) echo '[{"gpu": 0, "ecc": {"total_uncorrectable_count": 0}}, {"gpu": 1, "ecc": {"total_uncorrectable_count": '$errors'}}]';;
  bad-pages) echo '[]';;
esac
"""


def fake_amd_smi(directory: Path) -> tuple[Path, dict[str, str]]:
    """A fake ``amd-smi`` in ``directory/bin`` and the environment that puts it first on PATH; a
    file ``directory/ecc-all`` makes every process's GPU 1 report uncorrectable ECC errors."""
    (directory / "bin").mkdir(parents=True, exist_ok=True)
    tool = directory / "bin" / "amd-smi"
    tool.write_text(_FAKE_AMD_SMI)
    tool.chmod(0o755)
    env = {"PATH": f"{directory / 'bin'}:{os.environ['PATH']}", "ZAYA_FAKE_SMI": str(directory)}
    return directory, env


def corrupt_checkpoint(step_dir: Path) -> list[str]:
    """Overwrite every file of a committed checkpoint's training state with garbage of the same
    size (what a failing disk or an interrupted copy leaves); returns the files touched."""
    touched = []
    for path in sorted((step_dir / "train").rglob("*")):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(b"\xa5" * path.stat().st_size)
            touched.append(str(path.relative_to(step_dir)))
    return touched


def paused_marker(run: Path, step: int, process: int = 0) -> Path:
    """Written by process ``process`` once it waits after ``step`` (``pause_at_step``)."""
    return run / f"paused_{step}.{process}"


def signalled_marker(run: Path, step: int, process: int = 0) -> Path:
    """Written by a paused process once a SIGTERM/SIGINT reached it (and its trainer's handler)."""
    return run / f"signalled_{step}.{process}"


def release(run: Path, step: int) -> None:
    """Let every process paused after ``step`` go on."""
    write_atomic(run / f"release_{step}", "")


def pause(run: Path, step: int) -> None:
    """Wait after ``step`` until :func:`release`: write :func:`paused_marker`, then poll for the
    release file. A SIGTERM/SIGINT that arrives meanwhile goes to the handler that was installed
    (the trainer's) and is marked by :func:`signalled_marker`, so the test knows it was received
    before it releases the run."""
    me = jax.process_index()
    previous: dict[int, Any] = {}

    def handle(signum: int, frame: Any) -> None:
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        write_atomic(signalled_marker(run, step, me), signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handle)
    try:
        write_atomic(paused_marker(run, step, me), "")
        while not (run / f"release_{step}").exists():
            time.sleep(0.01)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_for_file(path: Path, procs: list[subprocess.Popen] = (), timeout: float = 600.0) -> None:
    """Wait until ``path`` exists; fail at once if one of ``procs`` ended first (the timeout only
    bounds a broken run, it decides nothing)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        ended = [p.args for p in procs if p.poll() is not None]
        assert not ended, f"a process ended before {path.name} appeared: {ended}"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout:.0f} s"
        time.sleep(0.02)


def signal_while_paused(
    run: Path,
    step: int,
    procs: list[subprocess.Popen],
    sig: int | dict[int, int],
    to: int = 0,
    processes: int = 1,
) -> None:
    """Every one of ``processes`` waits after ``step`` (``pause_at_step``); ``sig`` goes to
    ``procs[to]`` (a trainer, or a supervisor that forwards it), or ``sig={process: signal}`` to
    each process named, and once every one of them has received its signal all go on: the signals
    land at that step, whatever the timing."""
    for process in range(processes):
        wait_for_file(paused_marker(run, step, process), procs)
    signals = sig if isinstance(sig, dict) else {to: sig}
    for process, signum in signals.items():
        procs[process].send_signal(signum)
    for process in signals:
        wait_for_file(signalled_marker(run, step, process), procs)
    release(run, step)


def ecc_error_seen(health: Any, timeout_s: float = 300.0) -> None:
    """The last process's fake GPU reports ECC errors from now on; returns once its health thread
    has seen them (a condition, not a wait of some seconds), so the next step carries the failure."""
    marker = Path(os.environ["ZAYA_FAKE_SMI"]) / f"ecc-{os.getpid()}"
    marker.write_text("uncorrectable")
    deadline = time.monotonic() + timeout_s
    while health.monitor.failing is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the health thread did not see {marker} in {timeout_s:g} s")
        time.sleep(0.01)


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
        self.health = run.health
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

    def after_step(self, end: StepRecord) -> None:
        step, saved = end.step, end.saved
        if saved and self.due("crash_during_save_at_step", step):
            os.kill(os.getpid(), signal.SIGKILL)  # the save is still being written in the background
        if saved and self.due("corrupt_checkpoint_at_step", step):
            self.checkpoints.saver.finish()
            corrupt_checkpoint(self.run.checkpoints / str(step))
        if self.due("crash_at_step", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.due("hang_at_step", step):
            hang()
        if self.due("pause_at_step", step):
            pause(self.run.path, step)
        if self.due("gpu_ecc_at_step", step) and jax.process_index() == jax.process_count() - 1:
            ecc_error_seen(self.health)
        for name, rooms in (("disk_full_at_step", 1.0), ("disk_low_at_step", 1.5)):
            if self.due(name, step):
                for probe in self.health.rooms:  # what statfs would say of a filling disk
                    probe.free_bytes = lambda probe=probe, rooms=rooms: (
                        int(rooms * probe.checkpoint_bytes()) - 1
                    )


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
