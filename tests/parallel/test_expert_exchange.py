"""The ragged expert exchange (only routed rows travel, jax.lax.ragged_all_to_all) computes what the
padded all_to_all exchange computes, dropless and with a capacity, forward and backward; on 4 fake
CPU devices it runs through an emulation with the collective's documented semantics, and the real
collective is what the GPU program lowers to."""

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
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.parallel.exchange_worker"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_emulation_matches_the_documented_ragged_all_to_all_example(result):
    assert result["example"] == [[1, 3, 0, 0], [2, 2, 4, 0]]


@pytest.mark.parametrize("factor", ["0.0", "0.5"])
def test_ragged_exchange_equals_padded_exchange(result, factor):
    r = result[factor]
    assert r["out_scale"] > 1.0
    assert r["out"] <= 1e-6 * r["out_scale"]
    assert max(r["grads"]) <= 1e-6
    assert r["dropped_ragged"] == r["dropped_padded"]
    if factor == "0.0":
        assert r["dropped_padded"] == 0
    else:
        assert r["dropped_padded"] > 0


def test_ragged_exchange_lowers_to_the_collective(result):
    # tokens out, expert ids out, results back
    assert result["ragged_lowered"] == 3


def test_auto_exchange_is_padded_on_cpu():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from zaya_jax.parallel.expert import expert_dispatch, resolve_exchange

    mesh = Mesh(np.asarray(jax.devices()[:1]), ("expert",))
    assert resolve_exchange(mesh, "auto") == "padded"
    assert resolve_exchange(mesh, "ragged") == "ragged"
    with pytest.raises(ValueError, match="unknown expert exchange"):
        expert_dispatch(mesh, 0.0, "scatter")
