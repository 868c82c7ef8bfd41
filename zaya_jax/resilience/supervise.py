"""``zaya supervise``: run the trainer as a child process and keep it going.

The child is restarted, after a backoff, whenever it exits with a failure (a crash, a signal, the
hang watchdog's exit code 75) or stops beating its heartbeat; it resumes from its last complete
checkpoint by itself. The supervisor gives up when more than ``max_restarts`` failures fall
within ``window_s`` seconds, or at once on a usage or configuration error (exit code 2), which a
restart cannot fix. Every decision is a line of ``<run>/events.jsonl``.

One supervisor per host: under Slurm or Kubernetes each host runs ``zaya supervise -- zaya train
...`` for its own process; a failure in any process ends every process's collectives, so all of
them restart and meet again at the coordinator.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zaya_jax.resilience.watchdog import EXIT_HANG, HEARTBEAT

EXIT_USAGE = 2  # argparse and configuration errors: restarting cannot help


def run_dir_of(child: list[str]) -> Path:
    """The run directory a ``zaya train`` command line writes to (its config resolved the way the
    trainer resolves it)."""
    from zaya_jax.cli import build_parser
    from zaya_jax.config import load_config

    if "train" not in child:
        raise ValueError(f"cannot tell the run directory of {' '.join(child)!r}: pass --run-dir")
    args = build_parser().parse_args(child[child.index("train") :])
    return load_config(args.config, args.overrides).run.path


class Supervisor:
    def __init__(
        self,
        child: list[str],
        run_dir: Path,
        *,
        max_restarts: int = 5,
        window_s: float = 3600.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 300.0,
        heartbeat_timeout_s: float = 0.0,
        poll_s: float = 0.5,
    ):
        self.child, self.run_dir = child, Path(run_dir)
        self.max_restarts, self.window_s = max_restarts, window_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.heartbeat_timeout_s, self.poll_s = heartbeat_timeout_s, poll_s
        self.proc: subprocess.Popen | None = None
        self.stopping: str | None = None

    def event(self, name: str, **detail: Any) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        line = {
            "time": time.time(),
            "event": name,
            "step": None,
            "detail": {"source": "supervisor", **detail},
        }
        with (self.run_dir / "events.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"zaya supervise: {name} {json.dumps(detail)}", file=sys.stderr, flush=True)

    def _forward(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGINT (preemption, Ctrl-C): pass it on; the trainer saves and exits, and the
        supervisor does not restart it."""
        self.stopping = signal.Signals(signum).name
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def _heartbeat_age(self, started: float) -> float:
        path = self.run_dir / HEARTBEAT
        try:
            beat = json.loads(path.read_text())["time"]
        except (OSError, ValueError, KeyError):
            beat = started
        return time.time() - max(beat, started)

    def _wait(self, started: float) -> tuple[int, str | None]:
        """The child's exit code, and why the supervisor killed it (None if it exited on its own)."""
        while True:
            code = self.proc.poll()
            if code is not None:
                return code, None
            if self.heartbeat_timeout_s and not self.stopping:
                age = self._heartbeat_age(started)
                if age > self.heartbeat_timeout_s:
                    self.proc.kill()
                    return self.proc.wait(), f"no heartbeat for {age:.0f} s"
            time.sleep(self.poll_s)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        failures: collections.deque[float] = collections.deque()
        attempt = 0
        try:
            while True:
                attempt += 1
                started = time.time()
                self.event("child_start", attempt=attempt, command=self.child)
                self.proc = subprocess.Popen(self.child)
                code, killed = self._wait(started)
                if code == 0:
                    self.event("child_exit", attempt=attempt, code=0, interrupted_by=self.stopping)
                    return 0
                cause = killed or _describe(code)
                self.event("child_failed", attempt=attempt, code=code, cause=cause)
                if self.stopping:
                    return code if code > 0 else 128 - code
                if code == EXIT_USAGE:
                    self.event("give_up", reason="usage or configuration error: fix the command, then rerun")
                    return EXIT_USAGE
                now = time.time()
                failures.append(now)
                while failures and now - failures[0] > self.window_s:
                    failures.popleft()
                if len(failures) > self.max_restarts:
                    self.event(
                        "give_up",
                        reason=f"{len(failures)} failures within {self.window_s:g} s (--max-restarts {self.max_restarts})",
                    )
                    return 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (len(failures) - 1))
                self.event("restart", attempt=attempt + 1, after_s=delay, recent_failures=len(failures))
                time.sleep(delay)
                if self.stopping:
                    return 1
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == EXIT_HANG:
        return "hang watchdog (no progress; stacks in hang_stacks.txt)"
    return f"exit code {code}"


def main(args: Any) -> int:
    child = list(args.command)
    if child and child[0] == "--":
        child = child[1:]
    if not child:
        raise ValueError(
            "nothing to supervise: give the command after --, e.g. zaya supervise -- zaya train ..."
        )
    if child[0] == "zaya":  # the same installation as this supervisor, whatever PATH says
        child = [sys.executable, "-m", "zaya_jax.cli", *child[1:]]
    run_dir = Path(args.run_dir) if args.run_dir else run_dir_of(child)
    supervisor = Supervisor(
        child,
        run_dir,
        max_restarts=args.max_restarts,
        window_s=args.window,
        backoff_s=args.backoff,
        max_backoff_s=args.max_backoff,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return supervisor.run()
