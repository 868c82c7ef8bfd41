"""Choosing the next token of every row, each with its own sampling parameters and random stream.

Greedy rows take the argmax. A sampling row scales its logits by 1/temperature, keeps its top-k
(0 = off), then the smallest set whose probability reaches top-p (1 = off), and draws from what is
left with the key ``fold_in(fold_in(key(seed), stream), t)`` for its t-th new token: a row's draws
depend on its own seed, stream and step only, never on which slot it runs in, what shares its batch
or when it arrived. The log-probability returned is the chosen token's under the model's own
distribution (temperature 1, nothing filtered), which is what a training forward computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: int, top_p: jax.Array) -> jax.Array:
    """float32 logits (batch, vocab) scaled by 1/temperature, then with every token outside the top
    ``top_k`` (0 = off) and outside the smallest set whose probability reaches ``top_p`` (1 = off) set
    to -inf. The most likely token always survives. ``temperature`` and ``top_p`` are scalars or
    (batch, 1); ``top_k`` one static number (:func:`filter_rows` takes one per row)."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return _nucleus(logits, jnp.sort(logits, axis=-1)[..., ::-1], top_p)


def _nucleus(logits: jax.Array, ordered: jax.Array, top_p: jax.Array) -> jax.Array:
    """``logits`` without the tokens outside the smallest set whose probability reaches ``top_p``;
    ``ordered`` the same logits sorted in descending order."""
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (jnp.arange(logits.shape[-1]) == 0)
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def filter_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """:func:`filter_logits` with per-row parameters, each (batch,): the same tokens survive as
    there for every row (one sort serves both filters)."""
    logits = logits.astype(jnp.float32) / temperature[:, None]
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    k = jnp.clip(top_k - 1, 0, logits.shape[-1] - 1)[:, None]
    kth = jnp.where(top_k[:, None] > 0, jnp.take_along_axis(ordered, k, axis=-1), -jnp.inf)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    return _nucleus(logits, ordered, top_p[:, None])


def token_logprob(logits: jax.Array, token: jax.Array) -> jax.Array:
    """log p(token) under the unmodified logits (float32, temperature 1, nothing filtered)."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def choose(
    logits: jax.Array, rows: dict[str, jax.Array], step: jax.Array, vocab_limit: jax.Array
) -> jax.Array:
    """The next token of each row (batch,) int32 from its logits (batch, vocab). ``rows`` holds the
    per-row ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``seed`` and ``stream``; ``step`` (batch,)
    the index of the token being chosen; ids from ``vocab_limit`` on are never chosen. The sort and
    the draws run only when some row samples."""
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits.astype(jnp.float32), -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = rows["temperature"] > 0

    def sampled() -> jax.Array:
        temperature = jnp.where(sampling, rows["temperature"], 1.0)
        filtered = filter_rows(logits, temperature, rows["top_k"], rows["top_p"])

        def draw(seed, stream, t, row):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), t)
            return jax.random.categorical(key, row)

        drawn = jax.vmap(draw)(rows["seed"], rows["stream"], step, filtered).astype(jnp.int32)
        return jnp.where(sampling, drawn, greedy)

    return jax.lax.cond(jnp.any(sampling), sampled, lambda: greedy)
