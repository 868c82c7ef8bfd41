"""The ragged expert exchange (only routed rows travel, jax.lax.ragged_all_to_all) computes what the
padded all_to_all exchange computes, dropless and with a capacity, forward and backward; on 4 fake
CPU devices it runs through an emulation with the collective's documented semantics, and the real
collective is what the GPU program lowers to."""

from __future__ import annotations

import pytest

from tests.workers import run_worker


@pytest.fixture(scope="module")
def result():
    return run_worker("tests.parallel.exchange_worker", 4)


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


def test_the_probe_passes_a_correct_exchange_and_falls_back_to_padded_otherwise(result):
    """mesh.expert_exchange auto on an accelerator takes ragged only after a small layer through it
    equals padded (outputs, drops, gradients) on the live mesh; here the probe machinery runs on 4
    CPU devices with the emulated collective, a corrupting one and a failing one."""
    probe = result["probe"]
    assert probe["emulated"][0] == "emulated" and "equals padded" in probe["emulated"][1]
    assert probe["corrupt"][0] == "padded" and "differs from padded" in probe["corrupt"][1]
    assert probe["broken"][0] == "padded" and "UNIMPLEMENTED" in probe["broken"][1]
    assert len(probe["warnings"]) == 2 and all("using the padded exchange" in w for w in probe["warnings"])


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
