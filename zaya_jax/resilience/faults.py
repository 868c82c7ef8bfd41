"""Fault injection (``debug.*`` config keys, for tests only). Every fault fires at most once per run
directory: ``<run>/faults_fired.json`` records the ones that did, so a restarted run passes them."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from zaya_jax.config import DebugConfig
from zaya_jax.files import write_atomic

FIRED = "faults_fired.json"


class Faults:
    def __init__(self, debug: DebugConfig, run_dir: Path, *, primary: bool = True):
        self.debug, self.path, self.primary = debug, run_dir / FIRED, primary
        self.fired = set(json.loads(self.path.read_text())) if self.path.is_file() else set()

    def due(self, name: str, step: int) -> bool:
        """Whether fault ``name`` (a debug key) is set for ``step`` and has not fired yet; marks it
        fired (on disk, before it acts)."""
        if getattr(self.debug, name) != step or step == 0 or name in self.fired:
            return False
        self.fired.add(name)
        if self.primary:
            write_atomic(self.path, json.dumps(sorted(self.fired)))
        return True

    def crash(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def hang(self) -> None:
        while True:  # the watchdog ends the process
            time.sleep(3600)


def corrupt_checkpoint(step_dir: Path) -> list[str]:
    """Overwrite every file of a committed checkpoint's training state with garbage of the same
    size (what a failing disk or an interrupted copy leaves); returns the files touched."""
    touched = []
    for path in sorted((step_dir / "train").rglob("*")):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(b"\xa5" * path.stat().st_size)
            touched.append(str(path.relative_to(step_dir)))
    return touched
