"""Ring attention with the sequence split over 8 fake devices equals single-device attention
(causal, a document boundary inside a block, left padding, with and without a sliding window) in
outputs (padding rows included: zero in both) and gradients, and moves key/value blocks with
collective-permutes only (no all-gather)."""

from __future__ import annotations

import pytest

from tests.workers import run_worker


@pytest.fixture(scope="module")
def result():
    return run_worker("tests.parallel.ring_worker", 8)


@pytest.mark.parametrize("case", ["window=None", "window=0", "window=6"])
def test_ring_attention_equals_full_attention(result, case):
    got = result[case]
    assert got["forward"] < 1e-5
    assert got["grad"] < 1e-4
    # 7 ring steps x (keys, values, key segment ids, key padding mask); nothing gathered.
    assert got["collective_permute"] == 28
    assert got["all_gather"] == 0
