"""The engine's device programs over a slot cache, compiled once per shape and bucket.

The state is a fixed number of slots, each one sequence's decode cache (a slot cache of
:func:`zaya_jax.model.init_cache` with ``per_row=True``: keys, values, CCA's conv state and
delayed value, the key mask and the row's next slot; a sliding layer keeps only its window, in a
ring), its generated tokens, their
log-probabilities, the classes each layer chose for every token read (with routes) and its
sampling parameters. Four programs change it:

- :func:`admit_program` resets the slots given and installs their requests' parameters;
- :func:`prefill_program` reads the next chunk (``width`` tokens, real ones first) of ``rows``
  prompts, a bucket of rows gathered from the cache and written back, and samples the first
  token of those whose prompt ends in the chunk;
- :func:`decode_program` runs one-token steps of every live row in a device loop until a step
  budget is spent, every row is done, or (``yield_on_finish``) some row finished, so that the host
  can admit the next prompt into its slot at once;
- :func:`retire_program` marks rows done (a stop string seen by the host).

A row's cache slot index is its token's position: prompts are never padded, so a row computes
exactly what it computes alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.config import ModelConfig
from zaya_jax.engine.sampling import choose
from zaya_jax.model import Zaya, init_cache
from zaya_jax.model.cca import write_rows
from zaya_jax.model.stack import ROW_CACHE_KEYS
from zaya_jax.parallel.layout import program_hooks

State = dict[str, Any]
ROW_PARAMS = {  # per-row sampling parameters: dtype and the value of an empty slot
    "temperature": (jnp.float32, 0.0),
    "top_k": (jnp.int32, 0),
    "top_p": (jnp.float32, 1.0),
    "seed": (jnp.uint32, 0),
    "stream": (jnp.uint32, 0),
    "limit": (jnp.int32, 1),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What an engine's programs are compiled for: ``slots`` rows of ``capacity`` cache slots (a
    prompt and its new tokens), up to ``max_new`` new tokens and ``stops`` stop ids per row,
    ``routes``: record the class every layer chose; ``mesh``: a mesh whose ``context`` axis splits
    the cache slots (tree attention)."""

    slots: int
    capacity: int
    max_new: int
    stops: int
    routes: bool
    mesh: Mesh | None = None


def _model(cfg: ModelConfig, shape: Shape) -> Zaya:
    return Zaya(cfg, program_hooks(cfg, shape.mesh))


def _constrained(cache: dict[str, jax.Array], shape: Shape) -> dict[str, jax.Array]:
    """Keys, values and the key mask split along the cache slots over ``context``; the rest (the
    sliding layers' window caches too) replicated."""
    if shape.mesh is None:
        return cache
    kv = P(None, None, None, "context")  # (layers, batch, heads, positions, dim)
    split = {"keys": kv, "values": kv, "mask": P(None, "context")}
    return {
        name: jax.lax.with_sharding_constraint(x, NamedSharding(shape.mesh, split.get(name, P())))
        for name, x in cache.items()
    }


def empty_state(cfg: ModelConfig, shape: Shape) -> State:
    """Every slot free (not live, done)."""
    slots, layers = shape.slots, cfg.num_layers
    state = {
        "cache": _constrained(init_cache(cfg, slots, shape.capacity, per_row=True), shape),
        "last": jnp.zeros((slots,), jnp.int32),
        "count": jnp.zeros((slots,), jnp.int32),
        "live": jnp.zeros((slots,), bool),
        "done": jnp.ones((slots,), bool),
        "out": jnp.zeros((slots, shape.max_new), jnp.int32),
        "logprobs": jnp.zeros((slots, shape.max_new), jnp.float32),
        "stops": jnp.full((slots, shape.stops), -1, jnp.int32),
        "rows": {name: jnp.full((slots,), value, dtype) for name, (dtype, value) in ROW_PARAMS.items()},
    }
    if shape.routes:
        state["routes"] = jnp.full((slots, shape.capacity, layers), -1, jnp.int32)
    return state


@functools.lru_cache(maxsize=16)
def empty_state_program(cfg: ModelConfig, shape: Shape):
    return jax.jit(lambda: empty_state(cfg, shape))


@functools.lru_cache(maxsize=16)
def admit_program(cfg: ModelConfig, shape: Shape):
    """``(state, admitted (slots,) bool, rows {name: (slots,)}, stops (slots, n), pad_id) -> state``:
    the admitted slots emptied and given their requests' parameters."""

    def admit(state: State, admitted, rows, stops, pad_id):
        def reset(x, value, axis=0):
            where = admitted.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1))
            return jnp.where(where, jnp.asarray(value, x.dtype), x)

        cache = dict(state["cache"])
        for name in ("conv", "vdel"):
            cache[name] = reset(cache[name], 0, axis=1)
        cache["mask"], cache["index"] = reset(cache["mask"], 0), reset(cache["index"], 0)
        if "window_slots" in cache:  # the sliding layers' rings hold no position yet
            cache["window_slots"] = reset(cache["window_slots"], -1)
        new = {
            **state,
            "cache": _constrained(cache, shape),
            "count": reset(state["count"], 0),
            "live": reset(state["live"], False),
            "done": reset(state["done"], False),
            "out": reset(state["out"], pad_id),
            "logprobs": reset(state["logprobs"], 0.0),
            "stops": jnp.where(admitted[:, None], stops, state["stops"]),
            "rows": {k: jnp.where(admitted, rows[k].astype(v.dtype), v) for k, v in state["rows"].items()},
        }
        if shape.routes:
            new["routes"] = reset(state["routes"], -1)
        return new

    return jax.jit(admit, donate_argnums=0)


def _apply(model: Zaya, variables, tokens, mask, cache, routes: bool):
    """(logits, new cache, routes (batch, T, layers) or None)."""
    if not routes:
        logits, aux = model.apply(variables, tokens, token_mask=mask, cache=cache)
        return logits, aux["cache"], None
    (logits, aux), inter = model.apply(
        variables, tokens, token_mask=mask, cache=cache, mutable=["intermediates"]
    )
    choice = inter["intermediates"]["layers"]["router_choice"][0]  # (layers, batch, T)
    return logits, aux["cache"], jnp.moveaxis(choice, 0, -1).astype(jnp.int32)


def _emit(state: State, logits, sample, vocab_limit, rows_at=None) -> State:
    """Choose a token for the rows that ``sample`` (of ``rows_at``, default every slot) from their
    last real column's ``logits`` (n, vocab), and record it: output, log-probability, count,
    live, done (a stop id, or the row's token limit reached)."""
    at = jnp.arange(state["count"].shape[0]) if rows_at is None else rows_at
    pick = lambda x: jnp.take(x, at, axis=0, mode="clip")  # noqa: E731
    rows = {k: pick(v) for k, v in state["rows"].items()}
    count, stops = pick(state["count"]), pick(state["stops"])
    token, logprob = choose(logits, rows, count, vocab_limit)
    is_stop = jnp.any(token[:, None] == stops, axis=-1) | (count + 1 >= rows["limit"])
    column = jnp.arange(state["out"].shape[1])[None] == count[:, None]
    put = lambda x, value: x.at[at].set(value, mode="drop")  # noqa: E731
    write = sample[:, None] & column
    return {
        **state,
        "out": put(state["out"], jnp.where(write, token[:, None], pick(state["out"]))),
        "logprobs": put(state["logprobs"], jnp.where(write, logprob[:, None], pick(state["logprobs"]))),
        "count": put(state["count"], count + sample),
        "last": put(state["last"], jnp.where(sample, token, pick(state["last"]))),
        "live": put(state["live"], pick(state["live"]) | sample),
        "done": put(state["done"], pick(state["done"]) | (sample & is_stop)),
    }


def _last_real(logits: jax.Array, n: jax.Array) -> jax.Array:
    """(batch, vocab): each row's logits at its last real column (n - 1)."""
    return jnp.take_along_axis(logits, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]


@functools.lru_cache(maxsize=32)
def prefill_program(cfg: ModelConfig, shape: Shape, bucket: int, width: int):
    """``(variables, state, rows (bucket,), tokens (bucket, width), n (bucket,), sample (bucket,),
    vocab_limit) -> state``: the next ``n`` prompt tokens of each of ``rows`` (slots; ``shape.slots``
    pads the bucket and is dropped) read into their caches; rows that ``sample`` (their prompt ends
    here) get their first token."""
    model = _model(cfg, shape)

    def prefill(variables, state, rows, tokens, n, sample, vocab_limit):
        full = state["cache"]
        axis = lambda name: 0 if name in ROW_CACHE_KEYS else 1  # noqa: E731  (per row, or per layer)
        cache = {k: jnp.take(x, rows, axis=axis(k), mode="clip") for k, x in full.items()}
        start = cache["index"]
        mask = (jnp.arange(width)[None] < n[:, None]).astype(jnp.int32)
        logits, cache, read = _apply(model, variables, tokens, mask, cache, shape.routes)
        scatter = lambda x, new, axis: x.at[(slice(None),) * axis + (rows,)].set(new, mode="drop")  # noqa: E731
        new_cache = {k: scatter(full[k], cache[k], axis(k)) for k in full}
        state = {**state, "cache": _constrained(new_cache, shape)}
        if shape.routes:
            routes = write_rows(
                jnp.take(state["routes"], rows, axis=0, mode="clip"),
                jnp.where(mask[..., None] > 0, read, -1),
                start,
            )
            state["routes"] = scatter(state["routes"], routes, 0)
        return _emit(state, _last_real(logits, n), sample & (n > 0), vocab_limit, rows)

    return jax.jit(prefill, donate_argnums=1)


@functools.lru_cache(maxsize=16)
def fork_program(shape: Shape, bucket: int):
    """``(state, sources (bucket,), targets (bucket,)) -> state``: each target slot's cache (and
    routes) made a copy of its source slot's, a prompt read once for every slot that continues it
    (``shape.slots`` pads the bucket and is dropped). Nothing else of the target changes: it keeps
    its own sampling parameters and stream."""

    def fork(state, sources, targets):
        def copy(x, axis):
            picked = jnp.take(x, sources, axis=axis, mode="clip")
            return x.at[(slice(None),) * axis + (targets,)].set(picked, mode="drop")

        cache = {k: copy(x, 0 if k in ROW_CACHE_KEYS else 1) for k, x in state["cache"].items()}
        new = {**state, "cache": _constrained(cache, shape)}
        if shape.routes:
            new["routes"] = copy(state["routes"], 0)
        return new

    return jax.jit(fork, donate_argnums=0)


@functools.lru_cache(maxsize=16)
def decode_program(cfg: ModelConfig, shape: Shape):
    """``(variables, state, vocab_limit, max_steps, yield_on_finish) -> (state, steps run)``: one-token
    steps of every live, unfinished row, in a device loop."""
    model = _model(cfg, shape)

    def one_step(variables, state, vocab_limit):
        active = state["live"] & ~state["done"]
        n = active.astype(jnp.int32)
        start = state["cache"]["index"]
        logits, cache, read = _apply(
            model, variables, state["last"][:, None], n[:, None], state["cache"], shape.routes
        )
        state = {**state, "cache": _constrained(cache, shape)}
        if shape.routes:  # the classes chosen for the token just read (the last one generated)
            state["routes"] = write_rows(state["routes"], jnp.where(active[:, None, None], read, -1), start)
        return _emit(state, logits[:, 0], active, vocab_limit)

    def decode(variables, state, vocab_limit, max_steps, yield_on_finish):
        def cond(carry):
            state, steps, finished = carry
            running = jnp.any(state["live"] & ~state["done"])
            return (steps < max_steps) & running & ~(yield_on_finish & finished)

        def body(carry):
            state, steps, _ = carry
            new = one_step(variables, state, vocab_limit)
            return new, steps + 1, jnp.any(new["done"] & ~state["done"])

        state, steps, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0), jnp.bool_(False)))
        return state, steps

    return jax.jit(decode, donate_argnums=1)


@functools.lru_cache(maxsize=16)
def retire_program(shape: Shape):
    """``(state, rows (slots,) bool) -> state`` with those rows done."""
    return jax.jit(lambda state, rows: {**state, "done": state["done"] | rows}, donate_argnums=0)
