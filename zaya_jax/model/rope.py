"""Partial NeoX ("rotate-half") rotary position embedding (spec §2.3 step 6), with transformers'
``linear`` and ``yarn`` scaling (``modeling_rope_utils``: ``_compute_linear_scaling_rope_parameters``,
``_compute_yarn_parameters``), computed in float32 in the same order, so the frequencies are HF's
bit for bit."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import RopeScaling


def _powers(theta: float, rotary_dim: int) -> np.ndarray:
    """theta^(2i/rd) in float32, rounded once: torch's float32 ``pow`` is correctly rounded, numpy's
    float32 one is off by an ulp for some i (7 of 32 at theta 5e6), which grows to ~4e-3 in cos/sin
    at 131,072 positions."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)


def inverse_frequencies(theta: float, rotary_dim: int) -> np.ndarray:
    """inv_freq_i = theta^(-2i/rd), i < rd/2, in float32 exactly as HF computes it. Shape (rd/2,)."""
    return np.float32(1.0) / _powers(theta, rotary_dim)


def rope_frequencies(
    theta: float, rotary_dim: int, scaling: RopeScaling | None, truncate: bool = True
) -> tuple[np.ndarray, float]:
    """(inverse frequencies (rd/2,), cos/sin scale) of a layer type with ``scaling`` (None: plain)."""
    if scaling is None:
        return inverse_frequencies(theta, rotary_dim), 1.0
    factor = scaling.factor
    if scaling.rope_type == "linear":
        return inverse_frequencies(theta, rotary_dim) / np.float32(factor), 1.0
    powers, original = _powers(theta, rotary_dim), scaling.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.attention_factor
    if attention is None:
        both = scaling.mscale and scaling.mscale_all_dim
        attention = (
            mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
            if both
            else mscale(factor)
        )

    def dimension(rotations: float) -> float:  # the dimension turning ``rotations`` times over ``original``
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast or 32), dimension(scaling.beta_slow or 1)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip(
        (np.arange(rotary_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
    )
    kept = np.float32(1) - ramp  # the share of each dimension extrapolated (its frequency kept)
    extrapolated = np.float32(1.0) / powers
    interpolated = np.float32(1.0) / (np.float32(factor) * powers)
    return (interpolated * (np.float32(1) - kept) + extrapolated * kept).astype(np.float32), float(attention)


def rope_tables(
    positions: jax.Array, inv_freq: jax.Array, dtype: jnp.dtype, scale: jax.Array | float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables (batch, seq, rd), made in float32, times ``scale`` (yarn's attention factor),
    cast to ``dtype``. positions: (batch, seq)."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq.astype(jnp.float32)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if not (isinstance(scale, float) and scale == 1.0):  # unscaled: the program of no scaling
        cos, sin = cos * jnp.asarray(scale, jnp.float32), sin * jnp.asarray(scale, jnp.float32)
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate dims [0, rd) of every head with pairs (i, i + rd/2); dims [rd, d) pass through.

    x: (batch, seq, heads, d); cos, sin: (batch, seq, rd).
    """
    rd = cos.shape[-1]
    if rd == 0:
        return x
    rot, rest = x[..., :rd], x[..., rd:]
    first, second = rot[..., : rd // 2], rot[..., rd // 2 :]
    rotated = jnp.concatenate([-second, first], axis=-1)
    out = rot * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return jnp.concatenate([out, rest], axis=-1)
