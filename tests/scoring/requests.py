"""The model and the requests of tests/scoring/test_likelihood.py (also read by its 8-device
subprocess)."""

from __future__ import annotations

import numpy as np

from tests.random_model import tiny_config

CFG = tiny_config(sliding_window=8, layer_types=("hybrid_sliding", "hybrid"))


def random_requests(seed: int = 0, n: int = 40) -> list[tuple[list[int], list[int]]]:
    """Random requests, several sharing a context (multiple choice) and some the same input."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        context = rng.integers(2, CFG.vocab_size, rng.integers(1, 40)).tolist()
        for _ in range(rng.integers(1, 5)):
            out.append((context, rng.integers(2, CFG.vocab_size, rng.integers(1, 6)).tolist()))
        out.append((context, [int(rng.integers(2, CFG.vocab_size))]))  # one-token answers share a read
    return out
