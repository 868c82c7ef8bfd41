"""RMSNorm and ZAYA1's learned residual scaling (spec §2.1, §2.2)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from zaya_jax.model.layers import param_with_axes


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF ``ZayaRMSNorm``: normalise in float32, cast back to ``x.dtype``, then multiply by ``weight``.

    x: (..., features); weight: (features,), already in the compute dtype. No bias, no ``1 + w``.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, whose logical name is ``axis`` (``embed`` or ``router``)."""

    eps: float
    axis: str = "embed"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, weight_only: bool = False) -> jax.Array:
        """``weight_only``: return the weight (in the compute dtype) instead, for a fused kernel."""
        scale = param_with_axes(
            self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis,), self.param_dtype
        )
        if weight_only:
            return scale.astype(self.dtype)
        return rms_norm(x.astype(self.dtype), scale.astype(self.dtype), self.eps)


class ResidualScaling(nn.Module):
    """``(f + b_f) * s_f + (h + b_h) * s_h``: the branch in the compute dtype, the residual in float32.

    f: (batch, seq, embed) branch output (attention or MoE); h: (batch, seq, embed) float32 residual.
    Returns the new float32 residual stream. Note the form is (x + b) * s, not s * x + b (spec §2.2).
    """

    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self, f: jax.Array, h: jax.Array, weights_only: bool = False
    ) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``weights_only``: return (branch bias, branch scale, residual bias, residual scale)
        instead, for a fused kernel."""
        shape, axes = (h.shape[-1],), ("embed",)
        ones, zeros = nn.initializers.ones, nn.initializers.zeros
        hidden_scale = param_with_axes(self, "hidden_scale", ones, shape, axes, self.param_dtype)
        hidden_bias = param_with_axes(self, "hidden_bias", zeros, shape, axes, self.param_dtype)
        residual_scale = param_with_axes(self, "residual_scale", ones, shape, axes, self.param_dtype)
        residual_bias = param_with_axes(self, "residual_bias", zeros, shape, axes, self.param_dtype)
        if weights_only:
            return hidden_bias, hidden_scale, residual_bias, residual_scale
        branch = (f.astype(self.dtype) + hidden_bias.astype(self.dtype)) * hidden_scale.astype(self.dtype)
        residual = (h + residual_bias.astype(jnp.float32)) * residual_scale.astype(jnp.float32)
        return residual + branch.astype(jnp.float32)
