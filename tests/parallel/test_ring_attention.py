"""Ring attention with the sequence split over 8 fake devices (contiguous and zig-zag) equals single-device attention
(causal, a document boundary inside a block, left padding, with and without a sliding window) in
outputs (padding rows included: zero in both) and gradients, and moves key/value blocks with
collective-permutes only (no all-gather)."""

from __future__ import annotations

import pytest

from tests.workers import run_worker


@pytest.fixture(scope="module")
def result():
    return run_worker("tests.parallel.ring_worker", 8)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("window", ["None", "0", "6"])
def test_ring_attention_equals_full_attention(result, layout, window):
    got = result[f"{layout},window={window}"]
    assert got["forward"] < 1e-5
    assert got["grad"] < 1e-4
    # 7 ring steps x (keys, values, key segment ids, key padding mask); nothing gathered. Zig-zag:
    # plus two half-block exchanges for each of the 5 inputs reordered and the output restored.
    assert got["collective_permute"] == 28 + (12 if layout == "zigzag" else 0)
    assert got["all_gather"] == 0
