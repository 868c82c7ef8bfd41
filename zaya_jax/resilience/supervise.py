"""``zaya supervise``: run the trainer as a child process and keep it going.

The child is restarted, after a backoff, whenever it exits with a failure (a crash, a signal, the
hang watchdog's exit code 75) or stops beating its heartbeat; it resumes from its last complete
checkpoint by itself. The supervisor gives up when more than ``max_restarts`` failures fall
within ``window_s`` seconds, or at once on a usage or configuration error (exit code 2), which a
restart cannot fix. Every decision is a line of ``<run>/events.jsonl``.

One supervisor per host: under Slurm or Kubernetes each host runs ``zaya supervise -- zaya train
...`` for its own process; a failure in any process ends every process's collectives, so all of
them restart and meet again at the coordinator.

An unhealthy node (``resilience.on_unhealthy``, the trainer's exit codes 76 and 77 and
``<run>/drain.json``) is added to ``<run>/excluded_nodes.json`` with its reason. After a drain (76)
under Slurm, the supervisor of task 0 requeues the job with every excluded node in its
``ExcNodeList`` (``scontrol requeuehold``, ``update``, ``release``: a running job's exclusions cannot
be changed, a requeued one's can); elsewhere a supervisor on an excluded node gives up (the
scheduler replaces the host) and one on a healthy node restarts its trainer. A stop (77) gives up.
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

from zaya_jax.files import append_event, read_json, write_atomic
from zaya_jax.resilience.goodput import attempts, describe, totals
from zaya_jax.resilience.health import DRAIN_RECORD, EXIT_DRAIN, EXIT_UNHEALTHY, node_name
from zaya_jax.resilience.watchdog import EXIT_HANG, HEARTBEAT

EXIT_USAGE = 2  # argparse and configuration errors: restarting cannot help
EXCLUDED = "excluded_nodes.json"  # <run>/excluded_nodes.json: [{"node", "reason", "time", "step"}]


def excluded_nodes(run_dir: Path) -> list[dict[str, Any]]:
    """The run's excluded nodes, oldest first ([] when none)."""
    path = Path(run_dir) / EXCLUDED
    return json.loads(path.read_text()) if path.is_file() else []


def exclude(run_dir: Path, drain: dict[str, Any]) -> list[dict[str, Any]]:
    """Add the nodes of a drain record to ``<run>/excluded_nodes.json``; returns the ones new to it."""
    known = excluded_nodes(run_dir)
    names = {entry["node"] for entry in known}
    new = []
    for finding in drain.get("findings", []):
        if finding["node"] not in names:
            names.add(finding["node"])
            reason = f"{finding['probe']} probe: {finding['message']}"
            new.append(
                {
                    "node": finding["node"],
                    "reason": reason,
                    "time": drain.get("time"),
                    "step": drain.get("step"),
                }
            )
    if new:
        write_atomic(Path(run_dir) / EXCLUDED, json.dumps(known + new, indent=1))
    return new


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
        self.started = 0.0  # when the current child started
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
                started = self.started = time.time()
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
                if code == EXIT_UNHEALTHY or (code == EXIT_DRAIN and (self.run_dir / DRAIN_RECORD).is_file()):
                    ended = self._unhealthy(code)
                    if ended is not None:
                        return ended
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
            self._report()

    def _report(self) -> None:
        """The run's goodput over every attempt so far (the trainer's ``goodput.json``)."""
        summary = totals(attempts(self.run_dir))
        if summary is not None:
            self.event("goodput", **summary)
            print(f"zaya supervise: {describe(summary)}", file=sys.stderr, flush=True)

    def _unhealthy(self, code: int) -> int | None:
        """After a drain (76) or a stop (77): the nodes excluded, then the exit code, or None to
        restart here (another host was the unhealthy one)."""
        record = self.run_dir / DRAIN_RECORD
        if record.is_file() and record.stat().st_mtime >= self.started - 2:  # this child's (coarse mtimes)
            for entry in exclude(self.run_dir, read_json(record, "the drain record", "delete it and rerun")):
                self.event("node_excluded", **entry)
        nodes = [entry["node"] for entry in excluded_nodes(self.run_dir)]
        if code == EXIT_UNHEALTHY:
            reason = f"node {', '.join(nodes)} is unhealthy" if nodes else "a collective timed out"
            self.event("give_up", reason=f"{reason} and resilience.on_unhealthy=stop")
            return code
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            if os.environ.get("SLURM_PROCID", "0") == "0":
                self._requeue(job, nodes)
            return code
        if node_name() in nodes:
            self.event(
                "give_up", reason=f"this node ({node_name()}) is excluded: start the job on other nodes"
            )
            return code
        return None

    def _requeue(self, job: str, nodes: list[str]) -> None:
        """Requeue the Slurm job without ``nodes``: held first (a running job's exclusions cannot be
        changed), excluded, released; SIGTERM from the requeue is ignored until that is done."""
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            steps = [
                ["scontrol", "requeuehold", job],
                ["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}"],
                ["scontrol", "release", job],
            ]
            for command in steps:
                done = subprocess.run(command, capture_output=True, text=True, timeout=60)
                if done.returncode != 0:
                    self.event("requeue_failed", command=command, error=done.stderr.strip()[:500])
                    return
            self.event("requeue", job=job, excluded=nodes)
        finally:
            signal.signal(signal.SIGTERM, previous)


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == EXIT_HANG:
        return "hang watchdog (no progress; stacks in hang_stacks.txt)"
    if code in (EXIT_DRAIN, EXIT_UNHEALTHY):
        return f"unhealthy node ({'drained' if code == EXIT_DRAIN else 'stopped'}; see drain.json)"
    return f"exit code {code}"


def supervise_command(child: list[str], run_dir: Path, **options: Any) -> int:
    """Run ``child`` under a :class:`Supervisor` writing to ``run_dir``; its exit code. A leading
    ``zaya`` runs this very installation (``python -m zaya_jax.cli``), whatever PATH says."""
    if child and child[0] == "zaya":
        child = [sys.executable, "-m", "zaya_jax.cli", *child[1:]]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return Supervisor(child, run_dir, **options).run()
