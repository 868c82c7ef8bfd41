"""The one way tests run a worker module on fake CPU devices: a subprocess (XLA fixes the device
count at start-up), whose last line starting with ``RESULT `` is a JSON object."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_worker(module: str, devices: int, *extra_xla_flags: str, timeout: int = 600) -> dict[str, Any]:
    """Run ``python -m module`` with ``devices`` fake CPU devices; its RESULT object. A failed worker
    fails the test with the end of its stderr."""
    flags = [
        os.environ.get("XLA_FLAGS", ""),
        f"--xla_force_host_platform_device_count={devices}",
        *extra_xla_flags,
    ]
    env = {**os.environ, "XLA_FLAGS": " ".join(f for f in flags if f), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", module], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"{module} printed no RESULT line; stdout ends: {proc.stdout[-2000:]}"
    return json.loads(lines[-1][len("RESULT ") :])
