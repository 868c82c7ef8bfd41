"""Sampling with the CCA decode cache (spec §3): a jitted prefill of the left-padded prompts, then a
jitted ``while_loop`` of one-token decode steps that stops when every row has emitted a stop token.

Semantics follow Hugging Face ``generate``: prompts are left-padded to the longest one, positions
count real tokens only (a padded row gets the same positions as alone), the sliding window counts
cache slots, rows that have stopped emit ``pad_id``. Greedy (``temperature=0``) or sampling with
temperature, then top-k, then top-p (nucleus) filtering, in that order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.config import ModelConfig
from zaya_jax.model import Zaya, init_cache
from zaya_jax.model.mesh_hooks import ModelHooks
from zaya_jax.parallel.tree import tree_attention


@dataclasses.dataclass(frozen=True)
class Generation:
    """``tokens`` (batch, max_new_tokens) int32, ``pad_id`` after a row stops; ``lengths`` (batch,)
    generated tokens per row, the stop token included; ``stopped`` (batch,) whether the row emitted a
    stop token; ``texts`` the decoded continuations when a tokenizer was available.

    ``logprobs`` (batch, max_new_tokens) float32: each generated token's log-probability under the
    model's own distribution (temperature 1, no top-k/top-p filtering: what a training forward
    computes), 0 after the row stops.

    With ``return_routes=True``: ``prompt_routes`` (batch, prompt width, layers) and ``routes``
    (batch, max_new_tokens, layers) int32, the class each layer's router selected for each token the
    model read (an expert index, or E for the skip class), -1 where it read none: left padding, the
    last generated token (only ever a target) and everything after a row stops. ``prompt_lengths``
    (batch,) real prompt tokens per row. :meth:`row_routes` gives one row's routes aligned with its
    prompt followed by its generated tokens, as training replays them."""

    tokens: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray
    texts: list[str] | None = None
    logprobs: np.ndarray | None = None
    prompt_lengths: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None
    routes: np.ndarray | None = None

    def rows(self) -> list[list[int]]:
        """The generated ids of each row, without the padding after its stop."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]

    def row_routes(self, row: int) -> np.ndarray:
        """(prompt length + generated length, layers) routes of ``row``: its real prompt tokens,
        then its generated tokens (the last one -1: the model never read it)."""
        if self.routes is None or self.prompt_routes is None or self.prompt_lengths is None:
            raise ValueError("this generation has no routes: call generate(..., return_routes=True)")
        width = self.prompt_routes.shape[1]
        prompt = self.prompt_routes[row, width - int(self.prompt_lengths[row]) :]
        return np.concatenate([prompt, self.routes[row, : int(self.lengths[row])]])


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts -> (ids, mask), both (batch, longest) int32, real tokens right-aligned."""
    if not prompts:
        raise ValueError("no prompts given")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token")
    width = max(lengths)
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = np.asarray(prompt, np.int32)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: int, top_p: jax.Array) -> jax.Array:
    """float32 logits (batch, vocab) scaled by 1/temperature, then with every token outside the top
    ``top_k`` (0 = off) and outside the smallest set whose probability reaches ``top_p`` (1 = off) set
    to -inf. The most likely token always survives."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (jnp.arange(logits.shape[-1]) == 0)
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _cache_shardings(cache: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """Keys, values and slot mask split along the cache slots over ``context``; the rest replicated."""
    split = {"keys": P(None, None, "context"), "values": P(None, None, "context"), "mask": P(None, "context")}
    return {name: NamedSharding(mesh, split.get(name, P())) for name in cache}


def _token_logprob(logits: jax.Array, token: jax.Array) -> jax.Array:
    """log p(token) under the unmodified logits (float32, temperature 1, nothing filtered)."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def _apply(model: Zaya, variables: dict[str, Any], tokens: jax.Array, return_routes: bool, **kwargs: Any):
    """(logits, aux, routes): routes (batch, seq, layers) the classes selected, or None."""
    if not return_routes:
        logits, aux = model.apply(variables, tokens, **kwargs)
        return logits, aux, None
    (logits, aux), state = model.apply(variables, tokens, mutable=["intermediates"], **kwargs)
    choice = state["intermediates"]["layers"]["router_choice"][0]  # (layers, batch, seq)
    return logits, aux, jnp.moveaxis(choice, 0, -1).astype(jnp.int32)


@functools.lru_cache(maxsize=32)
def _generate_fn(
    cfg: ModelConfig,
    max_new_tokens: int,
    greedy: bool,
    top_k: int,
    stop_tokens: tuple[int, ...],
    mesh: Mesh | None = None,
    return_routes: bool = False,
):
    """The jitted sampler: ``(variables, ids, mask, key, temperature, top_p, vocab_limit, pad_id)
    -> {"tokens", "done", "logprobs"}`` plus ``"prompt_routes"`` and ``"routes"`` when
    ``return_routes`` (see :class:`Generation`)."""
    model = Zaya(cfg, ModelHooks(attention=tree_attention(mesh) if mesh is not None else None))
    layers = cfg.num_layers

    def choose(logits, key, temperature, top_p, vocab_limit):
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits.astype(jnp.float32), -jnp.inf)
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        filtered = filter_logits(logits, temperature, top_k, top_p)
        return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)

    def is_stop(token):
        stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)
        return jnp.any(token[:, None] == stops[None, :], axis=-1)

    def generate(variables, ids, mask, key, temperature, top_p, vocab_limit, pad_id):
        batch, prompt_len = ids.shape
        length = prompt_len + max_new_tokens
        if mesh is not None:  # tree attention: the cache slots split evenly over the context axis
            length = -(-length // mesh.shape["context"]) * mesh.shape["context"]
        cache = init_cache(cfg, batch, length)
        if mesh is not None:
            cache = jax.lax.with_sharding_constraint(cache, _cache_shardings(cache, mesh))
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        logits, aux, prompt_routes = _apply(
            model, variables, ids, return_routes, token_mask=mask, positions=positions, cache=cache
        )
        key, sub = jax.random.split(key)
        token = choose(logits[:, -1], sub, temperature, top_p, vocab_limit)
        out = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)
        logprobs = jnp.zeros((batch, max_new_tokens), jnp.float32)
        logprobs = logprobs.at[:, 0].set(_token_logprob(logits[:, -1], token))
        routes = jnp.full((batch, max_new_tokens, layers if return_routes else 0), -1, jnp.int32)
        loop = (aux["cache"], token, positions[:, -1] + 1, is_stop(token), out, logprobs, routes)
        state = (*loop, jnp.int32(1), key)

        def cond(state):
            done, step = state[3], state[-2]
            return (step < max_new_tokens) & ~jnp.all(done)

        def body(state):
            cache, token, position, done, out, logprobs, routes, step, key = state
            logits, aux, read = _apply(
                model, variables, token[:, None], return_routes, positions=position[:, None], cache=cache
            )
            if return_routes:  # the classes chosen for the token just read (generated at step - 1)
                read = jnp.where(done[:, None, None], -1, read)
                routes = jax.lax.dynamic_update_slice(routes, read, (0, step - 1, 0))
            key, sub = jax.random.split(key)
            token = jnp.where(done, pad_id, choose(logits[:, -1], sub, temperature, top_p, vocab_limit))
            logprob = jnp.where(done, 0.0, _token_logprob(logits[:, -1], token))
            out = jax.lax.dynamic_update_slice(out, token[:, None], (0, step))
            logprobs = jax.lax.dynamic_update_slice(logprobs, logprob[:, None], (0, step))
            done = done | is_stop(token)
            return aux["cache"], token, position + 1, done, out, logprobs, routes, step + 1, key

        _, _, _, done, out, logprobs, routes, _, _ = jax.lax.while_loop(cond, body, state)
        result = {"tokens": out, "done": done, "logprobs": logprobs}
        if return_routes:
            result["prompt_routes"] = jnp.where(mask[..., None] > 0, prompt_routes, -1)
            result["routes"] = routes
        return result

    return jax.jit(generate)


def _checked_ids(
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    attention_mask: npt.ArrayLike | None,
    max_new_tokens: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Prompts as left-padded (ids, mask), checked against the model."""
    if isinstance(prompts, np.ndarray) or attention_mask is not None:
        ids = np.asarray(prompts)
        ids = ids[None] if ids.ndim == 1 else ids
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"prompt ids must be integers of shape (batch, seq), got {ids.dtype} {ids.shape}"
            )
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask).reshape(ids.shape)
        if not np.all(mask[:, -1] == 1) or np.any(np.diff(mask.astype(np.int32), axis=1) < 0):
            raise ValueError(
                "attention_mask must be left padding (0s then 1s, last column all 1); "
                "pass ragged prompts as a list of lists to have them left-padded"
            )
        ids, mask = ids.astype(np.int32), mask.astype(np.int32)
    else:
        ids, mask = left_pad([list(p) for p in prompts], cfg.pad_token_id)
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size}); got {ids.min()}..{ids.max()}")
    if ids.shape[1] + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"model.max_position_embeddings={cfg.max_position_embeddings}; shorten one of them"
        )
    return ids, mask


def generate(
    cfg: ModelConfig,
    variables: dict[str, Any],
    prompts: Sequence[Sequence[int]] | np.ndarray,
    *,
    attention_mask: npt.ArrayLike | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] | None = None,
    seed: int = 0,
    vocab_limit: int | None = None,
    mesh: Mesh | None = None,
    return_routes: bool = False,
) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    ``prompts``: a list of token-id lists (ragged; left-padded here) or a (batch, seq) array, with
    ``attention_mask`` (1 = real token) when that array is already left-padded. ``stop_tokens``
    default to the model's ``stop_token_ids`` (``eos_token_id`` and the ``eos_token_ids`` list);
    ``vocab_limit`` keeps ids below it (a tokenizer smaller than a padded model vocabulary). ``temperature=0`` is greedy; ``seed`` makes sampling repeatable.
    ``mesh``: a mesh with a ``context`` axis over which the decode cache is split along its slots
    (tree attention, ``zaya_jax.parallel.tree``); the tokens are the same as on one device.
    ``return_routes``: also return the class every layer selected for every token read (router
    replay in training, :class:`Generation`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    ids, mask = _checked_ids(cfg, prompts, attention_mask, max_new_tokens)
    stops = cfg.stop_token_ids if stop_tokens is None else tuple(int(t) for t in stop_tokens)
    if cfg.moe_impl == "capacity":  # decoding routes a handful of tokens: never drop them
        cfg = dataclasses.replace(cfg, moe_impl="sorted")
    if mesh is not None and "context" not in mesh.shape:
        raise ValueError(
            f"generate(mesh=...) needs a mesh with a 'context' axis, got axes {tuple(mesh.shape)}"
        )
    fn = _generate_fn(cfg, max_new_tokens, temperature == 0.0, top_k, stops, mesh, return_routes)
    result = fn(
        variables,
        jnp.asarray(ids),
        jnp.asarray(mask),
        jax.random.key(seed),
        jnp.float32(temperature or 1.0),
        jnp.float32(top_p),
        jnp.int32(vocab_limit or cfg.vocab_size),
        jnp.int32(cfg.pad_token_id),
    )
    result = {name: np.asarray(value) for name, value in result.items()}
    out = result["tokens"]
    is_stop = np.isin(out, np.asarray(stops or (-1,)))
    first_stop = np.where(is_stop.any(axis=1), is_stop.argmax(axis=1) + 1, max_new_tokens)
    return Generation(
        tokens=out,
        lengths=first_stop.astype(np.int32),
        stopped=result["done"],
        logprobs=result["logprobs"],
        prompt_lengths=mask.sum(axis=1).astype(np.int32),
        prompt_routes=result.get("prompt_routes"),
        routes=result.get("routes"),
    )
