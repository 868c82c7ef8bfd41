"""Partial NeoX ("rotate-half") rotary position embedding (spec §2.3 step 6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(theta: float, rotary_dim: int) -> np.ndarray:
    """inv_freq_i = theta^(-2i/rd), i < rd/2, computed in float32 exactly as HF does. Shape (rd/2,)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables (batch, seq, rd), made in float32 and cast to ``dtype``. positions: (batch, seq)."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq.astype(jnp.float32)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


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
