"""Distributed Muon on a fsdp=4 x expert=2 mesh of fake CPU devices: no collective inside the
Newton-Schulz iteration, one gather per sharded Muon matrix, and updates exactly equal to the
single-device optimizer, for the CPU program and the GPU one (compiled on the same CPU devices). The
GSPMD default (no per-device NS) is compiled alongside for contrast."""

from __future__ import annotations

import pytest

from tests.workers import run_worker


@pytest.fixture(scope="module")
def result():
    return run_worker("tests.parallel.muon_worker", 8)


def test_no_collective_inside_the_newton_schulz_iteration(result):
    for program in ("", "gpu_"):  # the CPU program (a custom call per leaf) and the GPU one (a JAX loop)
        ours = result[program + "per_device_ns"]
        assert ours["in_loops"] == 0, program
        # One all-gather per Muon matrix split over fsdp; nothing else is communicated in the update.
        assert ours["total"] <= result["sharded_muon_leaves"] + 2, program
    # What GSPMD does unaided with the loop: it splits the NS matmuls and communicates in every
    # iteration (with the CPU's custom call it can only gather whole operands, outside any loop).
    assert result["gpu_gspmd"]["in_loops"] > 0


def test_sharded_updates_equal_the_single_device_optimizer(result):
    for program in ("", "gpu_"):
        assert result[program + "per_device_ns"]["max_error"] == 0.0, program
    assert result["muon_leaves"] >= result["sharded_muon_leaves"] >= 8
