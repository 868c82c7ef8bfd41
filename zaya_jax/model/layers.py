"""Small building blocks shared by the model modules: parameters with logical axis names, dense layers.

Logical axis names used by the model (mapped to mesh axes by one rules table per mesh preset):

=================  ==========================================================
``vocab``          vocabulary rows of the embedding / LM head
``embed``          the residual width H
``heads``          the flattened query latent nq*d
``kv``             the flattened key/value latent nk*d (and its halves)
``kv_heads``       one entry per KV head (``temp``)
``qk``             the C = (nq+nk)*d channels of the q/k convolution
``qk_heads``       the nq+nk heads of the grouped convolution
``head_dim``       one head's d channels
``conv``           convolution taps
``router``         the router width R
``router_classes`` the E+1 router classes (E experts + the skip)
``experts``        the expert stack
``expert_mlp``     an expert's hidden width (I, or 2I for fused gate/up)
``layers``         the scanned layer stack (added by ``nn.scan``)
=================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Initializer = Callable[..., jax.Array]


def param_with_axes(
    module: nn.Module,
    name: str,
    init: Initializer,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype: jnp.dtype,
) -> jax.Array:
    """Declare a parameter carrying logical axis names (one per dimension)."""
    if len(axes) != len(shape):
        raise ValueError(f"{name}: {len(axes)} axis names for a rank-{len(shape)} parameter")
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


class Dense(nn.Module):
    """``y = x @ kernel (+ bias)`` with kernel (in, out) named ``axes``; matmul in ``dtype``.

    Kernels are stored in the (in, out) layout; HF ``nn.Linear`` weights are their transpose.
    """

    features: int
    axes: tuple[str, str]
    use_bias: bool = False
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = param_with_axes(
            self,
            "kernel",
            nn.initializers.normal(self.init_std),
            (x.shape[-1], self.features),
            self.axes,
            self.param_dtype,
        )
        y = jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            bias = param_with_axes(
                self, "bias", nn.initializers.zeros, (self.features,), self.axes[1:], self.param_dtype
            )
            y = y + bias.astype(self.dtype)
        return y
