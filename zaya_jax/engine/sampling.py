"""Choosing the next token of every row, each with its own sampling parameters and random stream.

Greedy rows take the argmax. A sampling row scales its logits by 1/temperature, keeps its top-k
(0 = off), then the smallest set whose probability reaches top-p (1 = off)
(:mod:`zaya_jax.ops.sampling_filter`), and draws from what is left with the key
``fold_in(fold_in(key(seed), stream), t)`` for its t-th new token: a row's draws depend on its own
seed, stream and step only, never on which slot it runs in, what shares its batch or when it
arrived. The log-probability returned is the chosen token's under the distribution it was drawn
from (a greedy row's: the model's own, temperature 1, nothing filtered), which is what GRPO's
trainer computes for the same token (``rl.temperature``, ``rl.top_k``, ``rl.top_p``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zaya_jax.ops.sampling_filter import processed_logits


def filter_logits(
    logits: jax.Array, temperature: jax.Array | float, top_k: jax.Array | int, top_p: jax.Array | float
) -> jax.Array:
    """float32 logits (batch, vocab) scaled by 1/temperature, then with every token outside the top
    ``top_k`` (0 = off) and outside the smallest set whose probability reaches ``top_p`` (1 = off) set
    to -inf. The most likely token always survives. Each parameter is one number for every row or
    one per row, (batch,) (:func:`zaya_jax.ops.sampling_filter.processed_logits`)."""
    return processed_logits(logits, temperature, top_k, top_p)


filter_rows = filter_logits  # the per-row form: the same function, each parameter (batch,)


def token_logprob(logits: jax.Array, token: jax.Array) -> jax.Array:
    """log p(token) under the distribution of ``logits`` (batch, vocab) as given (float32)."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def choose(
    logits: jax.Array, rows: dict[str, jax.Array], step: jax.Array, vocab_limit: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The next token of each row (batch,) int32 from its logits (batch, vocab), and its
    log-probability (batch,) float32 under the distribution it was drawn from (a greedy row's: the
    model's own). ``rows`` holds the per-row ``temperature`` (0 = greedy), ``top_k``, ``top_p``,
    ``seed`` and ``stream``; ``step`` (batch,) the index of the token being chosen; ids from
    ``vocab_limit`` on are never chosen. The sort and the draws run only when some row samples."""
    raw = logits.astype(jnp.float32)
    limited = jnp.where(jnp.arange(raw.shape[-1]) < vocab_limit, raw, -jnp.inf)
    greedy = jnp.argmax(limited, axis=-1).astype(jnp.int32)
    sampling = rows["temperature"] > 0

    def sampled() -> tuple[jax.Array, jax.Array]:
        temperature = jnp.where(sampling, rows["temperature"], 1.0)
        filtered = filter_rows(limited, temperature, rows["top_k"], rows["top_p"])

        def draw(seed, stream, t, row):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), t)
            return jax.random.categorical(key, row)

        drawn = jax.vmap(draw)(rows["seed"], rows["stream"], step, filtered).astype(jnp.int32)
        token = jnp.where(sampling, drawn, greedy)
        logprob = jnp.where(sampling, token_logprob(filtered, token), token_logprob(raw, token))
        return token, logprob

    return jax.lax.cond(jnp.any(sampling), sampled, lambda: (greedy, token_logprob(raw, greedy)))
