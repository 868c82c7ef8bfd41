"""In-trainer liveness: a heartbeat file a supervisor can watch, and a watchdog thread that, when
no step finishes for ``timeout_s``, dumps every thread's stack and exits with :data:`EXIT_HANG`.

A step (not compiling, saving or restoring) that has not returned after
``runtime.collective_timeout_s`` is a ``collective_timeout`` (a peer or a link is gone: the step
waits in a collective that cannot finish): the stacks are dumped and ``resilience.on_unhealthy``
acts: ``drain`` and ``stop`` end the process (75: the supervisor restarts from the last checkpoint,
as the state on the devices cannot be saved; 77: it gives up), ``warn`` records it once and waits
on for the hang limit."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from zaya_jax.files import append_event, write_atomic
from zaya_jax.resilience.health import EXIT_UNHEALTHY

EXIT_HANG = 75  # the trainer made no progress for resilience.hang_timeout_s
HEARTBEAT = "heartbeat.json"
HANG_STACKS = "hang_stacks.txt"


class Watchdog:
    """``beat(step, phase)`` after every step (and around long phases: compiling, evaluating,
    saving, scoring preference pairs, which get ``slow_timeout_s``); the heartbeat file ``<run>/heartbeat.json`` holds the last beat. With a timeout, a
    daemon thread checks the time since the last beat and on expiry writes the stacks of every
    thread to ``<run>/hang_stacks.txt`` (and stderr), records a ``hang`` event and ends the
    process with exit code 75: a hung collective or a stuck input cannot be unblocked from inside."""

    SLOW_PHASES = ("init", "restore", "compile", "save", "reference")

    def __init__(
        self,
        run_dir: Path | None,
        timeout_s: float,
        slow_timeout_s: float = 0.0,
        *,
        enabled: bool = True,
        collective_timeout_s: float = 0.0,
        on_collective_timeout: str = "drain",
        exit: Callable[[int], None] = os._exit,
    ):
        self.run_dir, self.timeout_s = run_dir, timeout_s
        self.slow_timeout_s = max(slow_timeout_s, timeout_s)
        self.collective_timeout_s, self.on_collective_timeout = collective_timeout_s, on_collective_timeout
        self.enabled = enabled and run_dir is not None
        self.last = time.monotonic()
        self.step, self.phase = 0, "start"
        self.collective_reported = False
        self._exit = exit
        self._stop = threading.Event()
        self._thread = None
        checks = [t for t in (timeout_s, collective_timeout_s) if t > 0]
        self._every = min(1.0, min(checks, default=4.0) / 4)
        if checks:
            self._thread = threading.Thread(target=self._watch, name="zaya-watchdog", daemon=True)
            self._thread.start()

    def beat(self, step: int, phase: str = "step") -> None:
        self.last, self.step, self.phase = time.monotonic(), step, phase
        self.collective_reported = False
        if self.enabled:
            record = {"time": time.time(), "step": step, "phase": phase, "pid": os.getpid()}
            write_atomic(self.run_dir / HEARTBEAT, json.dumps(record), durable=False)

    def limit(self) -> float:
        return self.slow_timeout_s if self.phase in self.SLOW_PHASES else self.timeout_s

    def _watch(self) -> None:
        while not self._stop.wait(self._every):
            self.check(time.monotonic() - self.last)

    def check(self, idle: float) -> None:
        """Act on ``idle`` seconds without a beat (the thread calls it; tests call it directly)."""
        if self.timeout_s > 0 and idle > self.limit():
            self._fire(idle)
        elif (
            self.collective_timeout_s > 0
            and self.phase == "step"
            and idle > self.collective_timeout_s
            and not self.collective_reported
        ):
            self._collective_timeout(idle)

    def _collective_timeout(self, idle: float) -> None:
        action = self.on_collective_timeout
        message = (
            f"zaya: collective_timeout: step {self.step + 1} has waited {idle:.0f} s "
            f"(runtime.collective_timeout_s={self.collective_timeout_s:g}; resilience.on_unhealthy={action}); "
            "a peer or a network link is gone. Thread stacks follow"
        )
        self._dump(message)
        if self.enabled:
            detail = {"idle_s": idle, "limit_s": self.collective_timeout_s, "action": action}
            append_event(self.run_dir, "collective_timeout", self.step, detail)
        self.collective_reported = True
        if action != "warn":
            self._exit(EXIT_UNHEALTHY if action == "stop" else EXIT_HANG)

    def _dump(self, message: str) -> None:
        """``message`` and every thread's stack on stderr and in ``<run>/hang_stacks.txt``."""
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.enabled:
            with (self.run_dir / HANG_STACKS).open("w") as f:
                f.write(message + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)

    def _fire(self, idle: float) -> None:
        message = (
            f"zaya: no progress for {idle:.0f} s after step {self.step} (phase {self.phase}; "
            f"limit {self.limit():g} s, resilience.hang_timeout_s / compile_timeout_s); thread stacks follow, exiting with {EXIT_HANG}"
        )
        self._dump(message)
        if self.enabled:
            append_event(self.run_dir, "hang", self.step, {"phase": self.phase, "idle_s": idle})
        self._exit(EXIT_HANG)

    def close(self) -> None:
        self._stop.set()
