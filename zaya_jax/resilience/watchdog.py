"""In-trainer liveness: a heartbeat file a supervisor can watch, and a watchdog thread that, when
no step finishes for ``timeout_s``, dumps every thread's stack and exits with :data:`EXIT_HANG`."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

from zaya_jax.files import append_event, write_atomic

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
        self, run_dir: Path | None, timeout_s: float, slow_timeout_s: float = 0.0, *, enabled: bool = True
    ):
        self.run_dir, self.timeout_s = run_dir, timeout_s
        self.slow_timeout_s = max(slow_timeout_s, timeout_s)
        self.enabled = enabled and run_dir is not None
        self.last = time.monotonic()
        self.step, self.phase = 0, "start"
        self._stop = threading.Event()
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="zaya-watchdog", daemon=True)
            self._thread.start()

    def beat(self, step: int, phase: str = "step") -> None:
        self.last, self.step, self.phase = time.monotonic(), step, phase
        if self.enabled:
            record = {"time": time.time(), "step": step, "phase": phase, "pid": os.getpid()}
            write_atomic(self.run_dir / HEARTBEAT, json.dumps(record), durable=False)

    def limit(self) -> float:
        return self.slow_timeout_s if self.phase in self.SLOW_PHASES else self.timeout_s

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self.last
            if idle > self.limit():
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        message = (
            f"zaya: no progress for {idle:.0f} s after step {self.step} (phase {self.phase}; "
            f"limit {self.limit():g} s, resilience.hang_timeout_s / compile_timeout_s); thread stacks follow, exiting with {EXIT_HANG}"
        )
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.enabled:
            with (self.run_dir / HANG_STACKS).open("w") as f:
                f.write(message + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            append_event(self.run_dir, "hang", self.step, {"phase": self.phase, "idle_s": idle})
        os._exit(EXIT_HANG)

    def close(self) -> None:
        self._stop.set()
