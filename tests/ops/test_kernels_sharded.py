"""Kernels on 8 fake CPU devices with exact bfloat16 rounding (--xla_allow_excess_precision=false):
bf16 results against the reference, the fused norm under shard_map (rows stay split, parameter
gradients summed over devices), the model on a data-parallel layout with the kernels on, and the
Newton-Schulz kernel inside distributed Muon."""

from __future__ import annotations

import pytest

from tests.workers import run_worker


@pytest.fixture(scope="module")
def result():
    return run_worker("tests.ops.kernels_worker", 8, "--xla_allow_excess_precision=false")


def test_bfloat16_kernels_round_like_the_reference(result):
    for shape, errors in result["bf16"].items():
        assert errors["forward"] <= 1e-6, shape
        # parameter gradients: the reference sums rows in bf16, the kernel in float32
        assert errors["gradients"] <= 1e-2, shape


def test_fused_norm_under_shard_map_keeps_rows_split(result):
    r = result["sharded"]
    assert r["outputs"] <= 1e-6 and r["gradients"] <= 1e-6
    assert r["all_gathers"] == 0
    assert r["custom_calls"] >= 2  # forward and backward
    assert r["out_sharding"] == "P('data', 'context', None)"


def test_model_with_kernels_on_a_layout_matches_reference(result):
    assert result["model"]["loss"] <= 1e-5
    assert result["model"]["gradients"] <= 1e-5


def test_newton_schulz_kernel_inside_distributed_muon(result):
    r = result["muon"]
    assert r["error"] <= 1e-5
    assert r["custom_calls"] == 1
    assert r["sharding"] == "P('expert', 'fsdp', None)"
