"""Weight-only expert quantization as the exports store it (``zaya convert zaya-to-hf --quantize``),
computed in JAX so that the model can run with quantize-dequantize experts (``model.expert_quantization``).

Two formats, each with the rules of the ``compressed-tensors`` library that writes the exports
(``calculate_qparams``, ``generate_mx_scales``, ``round_to_quantized_type_args``), so that its
dequantized weights are these, value for value (``tests/interop/test_quantized.py``):

* ``fp8``: float8 e4m3 (largest 448) with one float32 scale per output channel, ``amax / 448``
  over the channel's inputs (an all-zero channel gets float32's eps); codes ``clip(w / s, ±448)``
  rounded to nearest even; dequantized ``code * s`` in float32. Per channel rather than in
  128 x 128 blocks: a block scale is what FP8 *activation* kernels pair with (compressed-tensors'
  ``FP8_BLOCK`` preset quantizes activations too), weight-only FP8 gains nothing from it, and a
  channel scale fits any width (a 128-block needs both dimensions divisible by 128, which small
  configs are not).
* ``mxfp4``: OCP MX FP4 (e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) over groups of 32
  consecutive inputs, each group with one power-of-two scale stored as its biased exponent (E8M0,
  a uint8): the group's largest magnitude rounded to a power of two (up when its mantissa is at
  least 1.75), over 4 (the largest e2m1 power of two); codes ``clip(w / s, ±6)`` rounded to nearest
  even; dequantized ``code * s`` (exact in bfloat16 and float32).

XLA:CPU flushes float32 subnormals to zero where torch keeps them, so a group of weights all below
2^-124 (about 5e-38; its scale 2^-127 is subnormal) dequantizes to zeros here and may give
subnormals in compressed-tensors; no trained weight is that small.

Every function takes the input axis (the one a matmul reduces over: ``in`` of an ``(in, out)``
kernel); the scale's shape keeps the other axes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

FORMATS = ("fp8", "mxfp4")

FP8_MAX = 448.0  # the largest float8 e4m3fn
FP4_MAX = 6.0  # the largest e2m1
MX_GROUP = 32  # inputs that share one MXFP4 scale
MX_ELEMENT_EXPONENT = 2  # floor(log2(6)): the largest e2m1 power of two
E8M0_BIAS = 127


def fp8_scales(w: jax.Array, axis: int) -> jax.Array:
    """One float32 scale per output channel (``axis`` reduced, kept as size 1)."""
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axis, keepdims=True)
    scale = _divide(amax, jnp.float32(FP8_MAX))
    return jnp.where(scale == 0, jnp.finfo(jnp.float32).eps, scale)


def fp8_codes(w: jax.Array, scales: jax.Array) -> jax.Array:
    """float8 e4m3fn codes of ``w`` under ``fp8_scales``."""
    return jnp.clip(_divide(w.astype(jnp.float32), scales), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def _divide(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x / y`` rounded as IEEE division. XLA:CPU multiplies by the rounded reciprocal of a divisor
    broadcast along an axis, an ulp off for about half the values; a divisor of ``x``'s shape behind
    an optimization barrier is divided element by element, as compressed-tensors (torch) does."""
    return x / jax.lax.optimization_barrier(jnp.broadcast_to(y, x.shape))


def _groups(w: jax.Array, axis: int) -> jax.Array:
    """``w`` with ``axis`` moved last and split into (groups, MX_GROUP)."""
    moved = jnp.moveaxis(w, axis, -1)
    if moved.shape[-1] % MX_GROUP:
        raise ValueError(f"mxfp4 needs the input axis ({moved.shape[-1]}) to be a multiple of {MX_GROUP}")
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // MX_GROUP, MX_GROUP)


def mxfp4_exponents(w: jax.Array, axis: int) -> jax.Array:
    """uint8 biased exponents (E8M0), shape: ``w``'s with ``axis`` moved last and divided by 32."""
    amax = jnp.max(jnp.abs(_groups(w, axis).astype(jnp.float32)), axis=-1)
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
    # round_to_power_2: a quarter of the leading binade added (e2m1's one mantissa bit, plus one),
    # then the mantissa dropped; the exponent field is then floor(log2) + 127 (0 for 0 and subnormals)
    field = ((bits + (1 << 21)) >> 23) & 0xFF
    return jnp.clip(field - MX_ELEMENT_EXPONENT, 0, 255).astype(jnp.uint8)


def mx_scales(exponents: jax.Array) -> jax.Array:
    """float32 ``2 ** (e - 127)`` of E8M0 exponents (0 for e = 0: see the module's note)."""
    return _power_of_two(exponents.astype(jnp.int32) - E8M0_BIAS)


def _power_of_two(k: jax.Array) -> jax.Array:
    """Exactly ``2.0 ** k`` in float32 for integers k in [-126, 127], built from its exponent bits
    (``jnp.exp2`` is ``exp(k ln 2)``, off for most k); 0 below -126, where it would be subnormal."""
    field = jnp.clip(k.astype(jnp.int32) + E8M0_BIAS, 0, 254)
    return jax.lax.bitcast_convert_type(jnp.left_shift(field, 23), jnp.float32)


def mxfp4_codes(w: jax.Array, exponents: jax.Array, axis: int) -> jax.Array:
    """e2m1 values (as float32) of ``w``'s groups, shape ``(..., groups, 32)`` as :func:`_groups`."""
    # times 2^(127 - e), exact, rather than over 2^(e - 127): that scale is subnormal for e = 0 (a
    # zero group), which XLA:CPU flushes to 0
    scaled = (
        _groups(w, axis).astype(jnp.float32)
        * _power_of_two(E8M0_BIAS - exponents.astype(jnp.int32))[..., None]
    )
    return _round_e2m1(jnp.clip(scaled, -FP4_MAX, FP4_MAX))


def _round_e2m1(x: jax.Array) -> jax.Array:
    """``x`` (within ±6) rounded to the nearest e2m1 value, ties to even, in float32. Not a cast to
    ``float4_e2m1fn``: XLA:CPU converts through a wider float first, and that double rounding moves
    values just under a tie (3.4999998 -> 4, not 3). The grid's step is 0.5 below 2, 1 below 4 and 2
    up to 6; dividing by a power of two is exact, and ``round`` takes ties to even."""
    magnitude = jnp.abs(x)
    step = jnp.where(magnitude < 2, 0.5, jnp.where(magnitude < 4, 1.0, 2.0)).astype(jnp.float32)
    return jnp.copysign(jnp.round(magnitude / step) * step, x)


def _dequantized(w: jax.Array, kind: str, axis: int) -> jax.Array:
    """The weight the export's dequantization gives, in float32."""
    if kind == "fp8":
        scales = fp8_scales(w, axis)
        return fp8_codes(w, scales).astype(jnp.float32) * scales
    if kind == "mxfp4":
        exponents = mxfp4_exponents(w, axis)
        values = mxfp4_codes(w, exponents, axis) * mx_scales(exponents)[..., None]
        moved = values.reshape(*values.shape[:-2], -1)
        return jnp.moveaxis(moved, -1, axis)
    raise ValueError(f"unknown expert quantization {kind!r}; use one of {', '.join(FORMATS)}")


def quantize_dequantize(w: jax.Array, kind: str, axis: int) -> jax.Array:
    """``w`` as its ``kind`` export dequantizes it, in float32 (as the export's dequantized weight is,
    whatever ``w``'s dtype); ``kind == "none"`` returns ``w``.

    The gradient passes straight through (the derivative of the rounding taken as 1), so a model
    trained with quantized experts learns weights whose quantized form fits (quantization-aware
    training); evaluation and sampling see exactly the exported model's experts.
    """
    if kind == "none":
        return w
    return _straight_through(w, kind, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _straight_through(w: jax.Array, kind: str, axis: int) -> jax.Array:
    return _dequantized(w, kind, axis)


@_straight_through.defjvp
def _straight_through_jvp(kind, axis, primals, tangents):
    (w,), (dw,) = primals, tangents
    return _straight_through(w, kind, axis), dw.astype(jnp.float32)
