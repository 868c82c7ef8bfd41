"""Model FLOPs per token and MFU (model FLOPs utilisation).

    flops_per_token = 6 * N_matmul_active + sum over layers of 12 * nq * d * K_mean(layer)

``N_matmul_active`` counts the weights one token multiplies (forward): the q/k/v/o projections,
the grouped q/k convolution (a per-token d x d matmul per head and tap), the router (down, fc1,
fc2, out), ONE expert's SwiGLU (top-1; a skip-routed token is still counted, so MFU is not
inflated by skipping) and the LM head; embedding lookups, norms and scalings are not matmuls.
The factor 6 is forward (2) + backward (4). The attention term counts QK^T and AV (2 * 2 * nq * d
FLOPs per attended key, forward; x3 with the backward) with K_mean = the mean number of keys a
query attends to: (T + 1) / 2 for causal attention, at most the window for sliding layers.

MFU = achieved model FLOP/s / peak FLOP/s of the devices. The peak comes from a table for known
accelerators (dense bf16 / fp32 tensor-core rates) and is *measured* on CPU with a large matmul,
since CPU peaks vary with the machine.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig

# Dense peak FLOP/s per device by (device kind substring, compute dtype).
_PEAKS = {
    ("MI300X", "bfloat16"): 1307e12,
    ("MI300X", "float32"): 163.4e12,
    ("MI325X", "bfloat16"): 1307e12,
    ("H200", "bfloat16"): 989e12,
    ("H200", "float32"): 67e12,
    ("H100", "bfloat16"): 989e12,
    ("H100", "float32"): 67e12,
    ("A100", "bfloat16"): 312e12,
    ("A100", "float32"): 19.5e12,
}


def matmul_params_per_token(cfg: ModelConfig) -> int:
    h, d, nq, nk = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    attention = h * nq * d + h * nk * d + h * nk * d + nq * d * h  # q, k, v (two halves), o
    conv = cfg.cca_time1 * (nq + nk) * d * d
    r = cfg.router_hidden_size
    router = h * r + 2 * r * r + r * (cfg.num_experts + 1)
    expert = 3 * h * cfg.moe_intermediate_size
    return cfg.num_layers * (attention + conv + router + expert) + h * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) at sequence length ``seq_len``."""
    attention = 0.0
    for layer_type in cfg.resolved_layer_types:
        keys = (seq_len + 1) / 2
        if layer_type == "hybrid_sliding" and cfg.sliding_window is not None:
            keys = min(keys, cfg.sliding_window)
        attention += 12 * cfg.num_heads * cfg.head_dim * keys
    return 6 * matmul_params_per_token(cfg) + attention


def measured_cpu_peak(size: int = 1024, repeats: int = 5) -> float:
    """Best float32 matmul FLOP/s of this CPU (all cores XLA uses)."""
    x = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops(dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of all devices of the job, how it was obtained). Tokens per step count the
    global batch, so the peak counts every process: a CPU host's measured peak once per process
    (fake CPU devices share their host), a GPU's datasheet peak once per device."""
    devices = jax.local_devices()
    if devices[0].platform == "cpu":
        return measured_cpu_peak() * jax.process_count(), "measured float32 matmul on CPU"
    kind = devices[0].device_kind
    for (name, table_dtype), peak in _PEAKS.items():
        if name.lower() in kind.lower() and table_dtype == dtype:
            return peak * jax.device_count(), f"datasheet dense {dtype} peak of {kind}"
    return float("nan"), f"unknown peak for {kind} ({dtype}); MFU not reported"
