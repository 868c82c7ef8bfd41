"""The fused norm's inputs and the relative error of tests/ops/test_kernels.py, shared by its
8-device worker (tests/ops/kernels_worker.py)."""

from __future__ import annotations

import jax
import numpy as np


def _inputs(shape, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 7)
    width = shape[-1]
    f = jax.random.normal(k[0], shape).astype(dtype)
    h = 3 * jax.random.normal(k[1], shape)
    near = [0.0, 1.0, 0.0, 1.0, 1.0]  # biases near 0, scales near 1
    params = [near[i] + 0.2 * jax.random.normal(k[2 + i], (width,)) for i in range(5)]
    return f, h, params


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
