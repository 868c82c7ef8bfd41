"""Sampling with the CCA decode cache (spec §3). :func:`generate` runs the rollout engine
(:mod:`zaya_jax.engine`: a slot cache, continuous batching) and returns its results as one
:class:`Generation`; :func:`static_generate` is the static sampler it replaced (a jitted prefill of
the left-padded prompts, then a jitted ``while_loop`` of one-token decode steps that stops when every
row has emitted a stop token), kept as the reference the engine is tested and benchmarked against.

Semantics follow Hugging Face ``generate``: positions count real tokens only (a padded row gets the
same positions as alone), the sliding window counts positions, rows that have stopped emit
``pad_id``. Greedy (``temperature=0``) or sampling with temperature, then top-k, then top-p
(nucleus) filtering, in that order.
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
from zaya_jax.engine import Engine, Finished, Request
from zaya_jax.engine.sampling import filter_logits, token_logprob
from zaya_jax.model import Zaya, init_cache
from zaya_jax.parallel.layout import program_hooks


@dataclasses.dataclass(frozen=True)
class Generation:
    """``tokens`` (batch, max_new_tokens) int32, ``pad_id`` after a row stops; ``lengths`` (batch,)
    generated tokens per row, the stop token included; ``stopped`` (batch,) whether the row emitted a
    stop token; ``texts`` the decoded continuations when a tokenizer was available.

    ``logprobs`` (batch, max_new_tokens) float32: each generated token's log-probability under the
    distribution it was drawn from (its temperature, top-k and top-p, ids past ``vocab_limit``
    excluded; greedy: the model's own at temperature 1): what GRPO's trainer computes for it with the
    same ``rl.temperature``, ``rl.top_k`` and ``rl.top_p``. 0 after the row stops.

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


def _cache_shardings(cache: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """Keys, values and slot mask split along the cache slots over ``context``; the rest replicated."""
    kv = P(None, None, None, "context")  # (layers, batch, heads, positions, dim)
    split = {"keys": kv, "values": kv, "mask": P(None, "context")}
    return {name: NamedSharding(mesh, split.get(name, P())) for name in cache}


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
    model = Zaya(cfg, program_hooks(cfg, mesh))
    layers = cfg.num_layers

    def choose(logits, key, temperature, top_p, vocab_limit):
        """(token, its log-probability under the distribution drawn from: greedy, the model's own)."""
        raw = logits.astype(jnp.float32)
        limited = jnp.where(jnp.arange(raw.shape[-1]) < vocab_limit, raw, -jnp.inf)
        if greedy:
            token = jnp.argmax(limited, axis=-1).astype(jnp.int32)
            return token, token_logprob(raw, token)
        filtered = filter_logits(limited, temperature, top_k, top_p)
        token = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
        return token, token_logprob(filtered, token)

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
        token, logprob = choose(logits[:, -1], sub, temperature, top_p, vocab_limit)
        out = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)
        logprobs = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(logprob)
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
            token, logprob = choose(logits[:, -1], sub, temperature, top_p, vocab_limit)
            token, logprob = jnp.where(done, pad_id, token), jnp.where(done, 0.0, logprob)
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


def static_generate(
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
    """The static sampler: every prompt left-padded into one batch, each row holding its place
    until the longest row stops, in one jitted ``while_loop`` (what :func:`generate` was before the
    engine; kept as the reference the engine is tested and benchmarked against). Arguments as
    :func:`generate`; sampling draws one key per step for the whole batch.

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


def _ragged(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """Left-padded (ids, mask) -> each row's real tokens."""
    return [row[m > 0].tolist() for row, m in zip(ids, mask, strict=True)]


def as_generation(
    results: Sequence[Finished], prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int
) -> Generation:
    """The engine's results as one :class:`Generation` (rows padded with ``pad_id``, prompt routes
    left-padded with -1 to the longest prompt)."""
    batch, width = len(results), max(len(p) for p in prompts)
    tokens = np.full((batch, max_new_tokens), pad_id, np.int32)
    logprobs = np.zeros((batch, max_new_tokens), np.float32)
    lengths = np.asarray([len(r.tokens) for r in results], np.int32)
    for row, result in enumerate(results):
        tokens[row, : lengths[row]], logprobs[row, : lengths[row]] = result.tokens, result.logprobs
    prompt_routes = routes = None
    if results[0].routes is not None:
        layers = results[0].routes.shape[-1]
        prompt_routes = np.full((batch, width, layers), -1, np.int32)
        routes = np.full((batch, max_new_tokens, layers), -1, np.int32)
        for row, (result, prompt) in enumerate(zip(results, prompts, strict=True)):
            prompt_routes[row, width - len(prompt) :] = result.routes[: len(prompt)]
            routes[row, : lengths[row]] = result.routes[len(prompt) :]
    return Generation(
        tokens=tokens,
        lengths=lengths,
        stopped=np.asarray([r.stopped for r in results]),
        logprobs=logprobs,
        prompt_lengths=np.asarray([len(p) for p in prompts], np.int32),
        prompt_routes=prompt_routes,
        routes=routes,
    )


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
    slots: int | None = None,
    prefill_chunk: int = 128,
    capacity: int | None = None,
    first_stream: int = 0,
) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens, through the rollout engine
    (:class:`zaya_jax.engine.Engine`: a slot cache, continuous batching).

    ``prompts``: a list of token-id lists (ragged) or a (batch, seq) array, with
    ``attention_mask`` (1 = real token) when that array is left-padded. ``stop_tokens``
    default to the model's ``stop_token_ids`` (``eos_token_id`` and the ``eos_token_ids`` list);
    ``vocab_limit`` keeps ids below it (a tokenizer smaller than a padded model vocabulary).
    ``temperature=0`` is greedy; with sampling, row i draws from the stream ``(seed, first_stream +
    i)``, so its tokens do not depend on the other rows (a share of a larger batch sampled elsewhere
    passes its first row's index). ``mesh``: a mesh with a ``context`` axis over which the
    decode cache is split along its slots (tree attention, ``zaya_jax.parallel.tree``); the tokens
    are the same as on one device. ``return_routes``: also return the class every layer selected
    for every token read (router replay in training, :class:`Generation`). ``slots``: rows in
    flight at once (default: every prompt); ``prefill_chunk``: prompt tokens a row reads per step;
    ``capacity``: cache slots per row, fixed so that calls of any prompt length share one program.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids, mask = _checked_ids(cfg, prompts, attention_mask, max_new_tokens)
    rows = _ragged(ids, mask)
    stops = cfg.stop_token_ids if stop_tokens is None else tuple(int(t) for t in stop_tokens)
    requests = [
        Request(row, max_new_tokens, temperature, top_k, top_p, seed, stream, tuple(stops))
        for stream, row in enumerate(rows, start=first_stream)
    ]
    engine = Engine(
        cfg,
        variables,
        slots=slots or len(rows),
        prefill_chunk=prefill_chunk,
        vocab_limit=vocab_limit,
        mesh=mesh,
        return_routes=return_routes,
        capacity=capacity,
    )
    return as_generation(engine.run(requests), rows, max_new_tokens, cfg.pad_token_id)
