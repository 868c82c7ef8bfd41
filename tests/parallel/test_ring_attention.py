"""Ring attention with the sequence split over 8 fake devices equals single-device attention
(causal, a document boundary inside a block, left padding, with and without a sliding window) in
outputs (padding rows included: zero in both) and gradients, and moves key/value blocks with
collective-permutes only (no all-gather)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def result():
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.parallel.ring_worker"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("case", ["window=None", "window=0", "window=6"])
def test_ring_attention_equals_full_attention(result, case):
    got = result[case]
    assert got["forward"] < 1e-5
    assert got["grad"] < 1e-4
    # 7 ring steps x (keys, values, key segment ids, key padding mask); nothing gathered.
    assert got["collective_permute"] == 28
    assert got["all_gather"] == 0
