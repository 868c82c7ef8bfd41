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
from types import FrameType
from typing import Any

from zaya_jax.files import append_event
from zaya_jax.resilience.watchdog import EXIT_HANG, HEARTBEAT

EXIT_USAGE = 2  # argparse and configuration errors: restarting cannot help


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
        append_event(self.run_dir, name, None, {"source": "supervisor", **detail})
        print(f"zaya supervise: {name} {json.dumps(detail)}", file=sys.stderr, flush=True)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
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


def supervise_command(child: list[str], run_dir: Path, **options: Any) -> int:
    """Run ``child`` under a :class:`Supervisor` writing to ``run_dir``; its exit code. A leading
    ``zaya`` runs this very installation (``python -m zaya_jax.cli``), whatever PATH says."""
    if child and child[0] == "zaya":
        child = [sys.executable, "-m", "zaya_jax.cli", *child[1:]]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return Supervisor(child, run_dir, **options).run()
