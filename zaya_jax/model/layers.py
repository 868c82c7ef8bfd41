"""Small building blocks shared by the model modules: parameters with logical axis names, dense layers.

Every axis name is one of the registry's (:mod:`zaya_jax.model.axes`); an unknown name is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from zaya_jax.model.axes import AXIS
from zaya_jax.model.lowrank import adapted

Initializer = Callable[..., jax.Array]


def param_with_axes(
    module: nn.Module,
    name: str,
    init: Initializer,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype: jnp.dtype,
) -> jax.Array:
    """Declare a parameter carrying logical axis names (one per dimension); read, it carries the
    low-rank adapter the parameters hold for it, if any (:func:`zaya_jax.model.lowrank.adapted`)."""
    if len(axes) != len(shape):
        raise ValueError(f"{name}: {len(axes)} axis names for a rank-{len(shape)} parameter")
    unknown = [a for a in axes if a is not None and a not in AXIS]
    if unknown:
        raise ValueError(
            f"{name}: logical axes {unknown} are not in zaya_jax.model.axes.AXES; add them there"
        )
    value = module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)
    return adapted(module, name, value)


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
    # Under remat "minimal" (which keeps the outputs of weight matmuls, dots without batch
    # dimensions), recompute this one's output instead: written as a dot with a batch of one.
    recomputed: bool = False

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
        if self.recomputed:  # a batch of one: not a plain weight matmul to the remat policy
            y = jnp.einsum("z...i,zio->z...o", x.astype(self.dtype)[None], kernel.astype(self.dtype)[None])[0]
        else:
            y = jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            bias = param_with_axes(
                self, "bias", nn.initializers.zeros, (self.features,), self.axes[1:], self.param_dtype
            )
            y = y + bias.astype(self.dtype)
        return y
