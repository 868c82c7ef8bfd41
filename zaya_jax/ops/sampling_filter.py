"""The distribution a token is sampled from: the logits scaled by 1/temperature, then only the top-k
(0 = off) and the smallest set whose probability reaches top-p (1 = off) kept, ids from the
vocabulary limit on never.

One definition for the two places that must agree to the token: the sampler draws from it
(:mod:`zaya_jax.engine.sampling`) and the policy-gradient trainer takes log-probabilities under it
(:func:`zaya_jax.ops.cross_entropy.chunked_cross_entropy`), so the gradient is that of the
distribution the rollouts came from (at temperature 1 it would be the gradient of another policy,
huggingface/trl#3029).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kept(logits: jax.Array, top_k: jax.Array | int, top_p: jax.Array | float) -> jax.Array:
    """Which tokens of ``logits`` (..., vocab; already divided by the temperature, -inf where never
    drawn) survive top-k and top-p: a bool mask like ``logits``. ``top_k`` and ``top_p`` are numbers
    or arrays shaped like ``logits[..., 0]``. The most likely token always survives; ``top_p >= 1``
    keeps every token (the cumulative sum's rounding drops none)."""
    top_k = jnp.asarray(top_k)[..., None]
    top_p = jnp.asarray(top_p, jnp.float32)[..., None]
    vocab = logits.shape[-1]
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    k = jnp.clip(top_k - 1, 0, vocab - 1)
    kth = jnp.where(
        top_k > 0, jnp.take_along_axis(ordered, jnp.broadcast_to(k, ordered[..., :1].shape), -1), -jnp.inf
    )
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (top_p >= 1) | (jnp.arange(vocab) == 0)
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return (logits >= threshold) & (logits >= kth) & (logits > -jnp.inf)


def processed_logits(
    logits: jax.Array,
    temperature: jax.Array | float = 1.0,
    top_k: jax.Array | int = 0,
    top_p: jax.Array | float = 1.0,
    vocab_limit: jax.Array | int | None = None,
) -> jax.Array:
    """float32 ``logits`` (..., vocab) as the sampler draws from them: divided by ``temperature``,
    -inf from ``vocab_limit`` on (ids the tokenizer does not have) and outside :func:`kept`.
    ``temperature``, ``top_k``, ``top_p`` and ``vocab_limit`` are numbers or arrays shaped like
    ``logits[..., 0]``; filters that are off (``top_k`` 0 and ``top_p`` 1, as Python numbers) cost
    no sort."""
    logits = logits.astype(jnp.float32)
    if not (isinstance(temperature, int | float) and temperature == 1):
        logits = logits / jnp.asarray(temperature, jnp.float32)[..., None]
    if vocab_limit is not None:
        allowed = jnp.arange(logits.shape[-1]) < jnp.asarray(vocab_limit)[..., None]
        logits = jnp.where(allowed, logits, -jnp.inf)
    if isinstance(top_k, int) and top_k == 0 and isinstance(top_p, int | float) and top_p >= 1:
        return logits
    return jnp.where(kept(logits, top_k, top_p), logits, -jnp.inf)
