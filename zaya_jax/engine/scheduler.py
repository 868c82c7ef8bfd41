"""The rollout engine: continuous batching of requests over a fixed number of cache slots.

:class:`Engine` takes any number of :class:`Request` s and keeps ``slots`` of them in flight. A
request enters a free slot, its prompt is read in chunks of ``prefill_chunk`` tokens (at most
``token_budget`` prompt tokens per prefill step, rows gathered into buckets of powers of two; rows
with at most ``NARROW_PREFILL`` tokens left to read go in a step that wide), then
every live row decodes one token per step in a device loop. When a row stops (a stop id, its
``max_new_tokens``, or a stop string the host finds in its text) and prompts are waiting, the loop
returns, the row's tokens are read, and the next prompt enters its slot at once; the other rows
keep their caches. Shapes are static (slots x capacity, one program per bucket), so nothing
recompiles while requests come and go.

Each row computes what it computes alone: prompts are not padded (a row's cache slot is its token's
position), and a sampling row draws from its own random stream (:mod:`zaya_jax.engine.sampling`),
so seeded sampling gives the same tokens whatever the arrival order, slot or batch.

Requests with the same prompt (GRPO's group: ``group_size`` completions of one prompt) read it once
(``share_prompts``): the first to hold a slot (the leader) reads all but the prompt's last token;
each other holder of that prompt waiting in a slot then gets a copy of the leader's cache (the CCA
keys and values of those positions, its conv and delay columns, positions and routes:
:func:`~zaya_jax.engine.programs.fork_program`), and every one of them reads the last token itself,
drawing its first token from its own stream. A request whose leader has already gone past that
point (it entered a slot later) reads its prompt alone.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from zaya_jax.config import ModelConfig
from zaya_jax.engine.programs import (
    ROW_PARAMS,
    Shape,
    admit_program,
    decode_program,
    empty_state_program,
    fork_program,
    prefill_program,
    retire_program,
)


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt (token ids) and how to continue it. ``temperature`` 0 is greedy; ``seed`` and
    ``stream`` name the row's random stream; ``stop_tokens`` end the row when generated (kept as its
    last token); ``stop_strings`` end it when its decoded text contains one (needs the engine's
    ``decode``)."""

    prompt: Sequence[int]
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stream: int = 0
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request's result: ``tokens`` the generated ids (the stop token included), ``logprobs``
    each one's log-probability under the distribution it was drawn from (the request's temperature,
    top-k, top-p and vocabulary; a greedy request's: the model's own), ``stopped`` whether a
    stop id or string ended it (else ``max_new_tokens`` did), ``routes`` (prompt + generated,
    layers) the class each layer chose for every token read (-1 for the last generated token, which
    the model never read), with ``return_routes``."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stopped: bool
    routes: np.ndarray | None = None


@dataclasses.dataclass
class EngineStats:
    """Work done by :meth:`Engine.run`: program calls and the tokens they read and wrote."""

    prefill_calls: int = 0
    prompt_tokens: int = 0
    shared_prompt_tokens: int = 0  # prompt tokens not read: copied from a leader's cache (share_prompts)
    decode_calls: int = 0
    decode_steps: int = 0
    new_tokens: int = 0


# A prefill step's rows whose pieces are this short (a forked group's last prompt tokens, a prompt's
# tail) are read in a step this wide, not a whole chunk wide: one token of 128 columns was most of
# a shared prompt's cost at hundreds of slots.
NARROW_PREFILL = 16


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_request(cfg: ModelConfig, request: Request, index: int) -> None:
    """A :class:`ValueError` naming the request and what to change, for a request the model cannot run."""
    where = f"request {index}"
    if len(request.prompt) == 0:
        raise ValueError(f"{where}: the prompt is empty; every prompt needs at least one token")
    ids = np.asarray(request.prompt)
    if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"{where}: prompt ids must be integers in [0, {cfg.vocab_size})")
    if request.max_new_tokens < 1:
        raise ValueError(f"{where}: max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if request.temperature < 0:
        raise ValueError(f"{where}: temperature must be >= 0 (0 = greedy), got {request.temperature}")
    if request.top_k < 0:
        raise ValueError(f"{where}: top_k must be >= 0 (0 = off), got {request.top_k}")
    if not 0.0 < request.top_p <= 1.0:
        raise ValueError(f"{where}: top_p must be in (0, 1] (1 = off), got {request.top_p}")
    if len(request.prompt) + request.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"{where}: prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
            f"exceeds model.max_position_embeddings={cfg.max_position_embeddings}; shorten one of them"
        )


class Engine:
    """Continuous batching over ``slots`` cache slots (see the module doc).

    ``variables``: the model's ``{"params", "balancing"}`` (adapters folded as the model reads
    them). ``prefill_chunk``: prompt tokens a row reads per prefill step; ``token_budget``: prompt
    tokens per prefill step over all rows (default ``slots * prefill_chunk``, at least one chunk).
    ``vocab_limit``: ids from it on are never generated (a tokenizer smaller than the model's
    vocabulary). ``decode``: ids -> text, for stop strings. ``mesh``: a mesh with a ``context`` axis
    over which the cache slots are split (tree attention). ``return_routes``: record routes.
    ``capacity``: cache slots per row (a prompt and its new tokens) for every call, so that calls
    of any length share one program (default: the longest request's, rounded up to 64).
    ``share_prompts``: requests with the same prompt read it once (see the module doc).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        variables: dict[str, Any],
        *,
        slots: int = 64,
        prefill_chunk: int = 128,
        token_budget: int | None = None,
        vocab_limit: int | None = None,
        decode: Callable[[list[int]], str] | None = None,
        mesh: Mesh | None = None,
        return_routes: bool = False,
        capacity: int | None = None,
        share_prompts: bool = True,
    ):
        if slots < 1 or prefill_chunk < 1:
            raise ValueError(f"slots ({slots}) and prefill_chunk ({prefill_chunk}) must be >= 1")
        if mesh is not None and "context" not in mesh.shape:
            raise ValueError(f"a mesh for decoding needs a 'context' axis, got axes {tuple(mesh.shape)}")
        budget = token_budget or slots * prefill_chunk
        if budget < prefill_chunk:
            raise ValueError(f"token_budget={budget} must hold one prefill_chunk ({prefill_chunk} tokens)")
        if cfg.moe_impl == "capacity":  # decoding routes a handful of tokens: never drop them
            cfg = dataclasses.replace(cfg, moe_impl="sorted")
        self.cfg, self.variables = cfg, variables
        self.slots, self.chunk, self.max_rows = slots, prefill_chunk, min(slots, budget // prefill_chunk)
        self.vocab_limit = jnp.int32(vocab_limit or cfg.vocab_size)
        self.decode, self.mesh, self.return_routes = decode, mesh, return_routes
        self.capacity, self.stats, self.share_prompts = capacity, EngineStats(), share_prompts

    def _shape(self, requests: Sequence[Request]) -> Shape:
        """Capacity and buffers rounded up (64 slots, 4 stop ids), so that similar calls share programs."""
        longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
        if self.capacity is not None and longest > self.capacity:
            raise ValueError(
                f"a request needs {longest} cache slots (prompt + max_new_tokens), more than the engine's "
                f"capacity={self.capacity}; shorten the prompt or raise the capacity"
            )
        capacity = self.capacity or _round_up(longest, 64)
        if self.mesh is not None:
            capacity = _round_up(capacity, self.mesh.shape["context"])
        stops = _round_up(max(1, *(len(r.stop_tokens) for r in requests)), 4)
        max_new = _round_up(max(r.max_new_tokens for r in requests), 64)
        return Shape(self.slots, capacity, max_new, stops, self.return_routes, self.mesh)

    def run(
        self, requests: Sequence[Request], on_finish: Callable[[int, Finished], None] | None = None
    ) -> list[Finished]:
        """Every request's :class:`Finished`, in request order; ``on_finish(index, finished)`` is
        called as each one finishes (in finishing order)."""
        for i, request in enumerate(requests):
            check_request(self.cfg, request, i)
        if any(r.stop_strings for r in requests) and self.decode is None:
            raise ValueError(
                "stop_strings need the engine's decode (a tokenizer): Engine(..., decode=tok.decode)"
            )
        if not requests:
            return []
        return _Run(self, list(requests), on_finish).finish()


class _Run:
    """One :meth:`Engine.run`: the host side of the slots (which request each holds, how much of its
    prompt is read) and the loop admit -> prefill -> decode -> harvest."""

    def __init__(self, engine: Engine, requests: list[Request], on_finish):
        self.engine, self.requests, self.on_finish = engine, requests, on_finish
        self.shape = engine._shape(requests)
        cfg = engine.cfg
        self.state = empty_state_program(cfg, self.shape)()
        self.queue = collections.deque(range(len(requests)))
        self.holder: list[int | None] = [None] * self.shape.slots  # request index per slot
        self.read = [0] * self.shape.slots  # prompt tokens read per slot
        self.results: list[Finished | None] = [None] * len(requests)
        self.pad = jnp.int32(cfg.pad_token_id)
        # the first request of each prompt (of 2 tokens or more) leads the others that share it
        self.leader: list[int | None] = [None] * len(requests)
        if engine.share_prompts:
            first: dict[tuple[int, ...], int] = {}
            for i, request in enumerate(requests):
                key = tuple(int(t) for t in request.prompt)
                if len(key) > 1 and (leader := first.setdefault(key, i)) != i:
                    self.leader[i] = leader

    def finish(self) -> list[Finished]:
        while self.queue or any(h is not None for h in self.holder):
            self._admit()
            if not self._prefill():
                self._decode()
            self._harvest()
        return self.results  # type: ignore[return-value]

    def _admit(self) -> None:
        free = [s for s, h in enumerate(self.holder) if h is None]
        if not free or not self.queue:
            return
        slots = self.shape.slots
        admitted = np.zeros(slots, bool)
        rows = {name: np.full(slots, value, np.dtype(dtype)) for name, (dtype, value) in ROW_PARAMS.items()}
        stops = np.full((slots, self.shape.stops), -1, np.int32)
        for slot in free[: len(self.queue)]:
            index = self.queue.popleft()
            request = self.requests[index]
            self.holder[slot], self.read[slot], admitted[slot] = index, 0, True
            rows["temperature"][slot], rows["top_k"][slot], rows["top_p"][slot] = (
                request.temperature,
                request.top_k,
                request.top_p,
            )
            rows["seed"][slot], rows["stream"][slot] = request.seed % 2**32, request.stream % 2**32
            rows["limit"][slot] = request.max_new_tokens
            stops[slot, : len(request.stop_tokens)] = request.stop_tokens
        admit = admit_program(self.engine.cfg, self.shape)
        self.state = admit(self.state, jnp.asarray(admitted), rows, jnp.asarray(stops), self.pad)

    def _leader_slot(self, slot: int) -> int | None:
        """The slot of the leader of the request in ``slot`` while it still holds the prompt's cache
        up to its last token unread (it stops there for its followers), else None."""
        leader = self.leader[self.holder[slot]]
        if leader is None:
            return None
        at = next((s for s, h in enumerate(self.holder) if h == leader), None)
        if at is None or self.read[at] > len(self.requests[leader].prompt) - 1:
            return None
        return at

    def _fork(self) -> None:
        """Copy each waiting follower's leader's cache to it, where the leader has read all but the
        prompt's last token."""
        pairs = [
            (at, s)
            for s, h in enumerate(self.holder)
            if h is not None and self.read[s] == 0 and (at := self._leader_slot(s)) is not None
            and self.read[at] == len(self.requests[h].prompt) - 1
        ]  # fmt: skip
        if not pairs:
            return
        bucket = 1 << (len(pairs) - 1).bit_length()
        sources = np.full(bucket, self.shape.slots, np.int32)
        targets = np.full(bucket, self.shape.slots, np.int32)
        for i, (at, slot) in enumerate(pairs):
            sources[i], targets[i] = at, slot
            self.read[slot] = self.read[at]
            self.engine.stats.shared_prompt_tokens += self.read[at]
        self.state = fork_program(self.shape, bucket)(self.state, jnp.asarray(sources), jnp.asarray(targets))

    def _end(self, slot: int) -> int:
        """Where this prefill step stops reading the prompt in ``slot``: its end, or the token before
        its last while followers wait in slots for a copy of its cache."""
        request = self.holder[slot]
        end = len(self.requests[request].prompt)
        waiting = any(
            h is not None and self.leader[h] == request and self.read[s] == 0
            for s, h in enumerate(self.holder)
        )
        return end - 1 if waiting and self.read[slot] < end - 1 else end

    def _prefill(self) -> bool:
        """One prefill step of the slots whose prompts are not fully read; False if there are none.
        A follower waits while its leader reads (then gets a copy of its cache: :meth:`_fork`)."""
        engine = self.engine
        self._fork()
        waiting = [
            s
            for s, h in enumerate(self.holder)
            if h is not None and self.read[s] < len(self.requests[h].prompt)
            and not (self.read[s] == 0 and self._leader_slot(s) is not None)
        ]  # fmt: skip
        if not waiting:
            return False
        waiting = waiting[: engine.max_rows]
        pieces = {slot: min(engine.chunk, self._end(slot) - self.read[slot]) for slot in waiting}
        narrow = min(NARROW_PREFILL, engine.chunk)
        for width, rows in (
            (engine.chunk, [slot for slot in waiting if pieces[slot] > narrow]),
            (narrow, [slot for slot in waiting if pieces[slot] <= narrow]),
        ):
            if rows:
                self._prefill_rows(rows, width)
        return True

    def _prefill_rows(self, waiting: list[int], width: int) -> None:
        """The next at most ``width`` prompt tokens of each slot of ``waiting`` read in one step."""
        engine = self.engine
        bucket = min(1 << (len(waiting) - 1).bit_length(), engine.max_rows)
        rows = np.full(bucket, self.shape.slots, np.int32)
        tokens = np.zeros((bucket, width), np.int32)
        n, sample = np.zeros(bucket, np.int32), np.zeros(bucket, bool)
        for i, slot in enumerate(waiting):
            prompt = self.requests[self.holder[slot]].prompt
            piece = np.asarray(
                prompt[self.read[slot] : min(self.read[slot] + width, self._end(slot))], np.int32
            )
            rows[i], n[i] = slot, len(piece)
            tokens[i, : len(piece)] = piece
            self.read[slot] += len(piece)
            sample[i] = self.read[slot] == len(prompt)
        program = prefill_program(engine.cfg, self.shape, bucket, width)
        self.state = program(
            engine.variables, self.state, *map(jnp.asarray, (rows, tokens, n, sample)), engine.vocab_limit
        )
        engine.stats.prefill_calls += 1
        engine.stats.prompt_tokens += int(n.sum())

    def _decode(self) -> None:
        engine = self.engine
        watching = any(self.requests[h].stop_strings for h in self.holder if h is not None)
        max_steps = 16 if watching else self.shape.max_new
        program = decode_program(engine.cfg, self.shape)
        self.state, steps = program(
            engine.variables,
            self.state,
            engine.vocab_limit,
            jnp.int32(max_steps),
            jnp.bool_(bool(self.queue)),
        )
        engine.stats.decode_calls += 1
        engine.stats.decode_steps += int(steps)

    def _harvest(self) -> None:
        """Read the rows that finished (or whose text holds a stop string) and free their slots."""
        live, done, count = (np.asarray(self.state[k]) for k in ("live", "done", "count"))
        finished = [s for s, h in enumerate(self.holder) if h is not None and live[s] and done[s]]
        cut = self._stop_strings(live, done, count)
        if cut:
            retire = np.zeros(self.shape.slots, bool)
            retire[list(cut)] = True
            self.state = retire_program(self.shape)(self.state, jnp.asarray(retire))
            finished += [s for s in cut if s not in finished]
        if not finished:
            return
        out, logprobs = np.asarray(self.state["out"]), np.asarray(self.state["logprobs"])
        routes = np.asarray(self.state["routes"][np.asarray(finished)]) if self.shape.routes else None
        for i, slot in enumerate(finished):
            index = self.holder[slot]
            request, n = self.requests[index], int(cut.get(slot, count[slot]))
            stopped = slot in cut or (n > 0 and int(out[slot, n - 1]) in request.stop_tokens)
            row_routes = None
            if routes is not None:
                row_routes = routes[i, : len(request.prompt) + n].copy()
                row_routes[-1] = -1  # the last generated token was never read
            result = Finished(out[slot, :n].copy(), logprobs[slot, :n].copy(), bool(stopped), row_routes)
            self.results[index], self.holder[slot] = result, None
            self.engine.stats.new_tokens += n
            if self.on_finish is not None:
                self.on_finish(index, result)

    def _stop_strings(self, live, done, count) -> dict[int, int]:
        """Slots whose generated text holds one of their stop strings -> tokens to keep (through the
        token that completed the string)."""
        cut: dict[int, int] = {}
        watched = [
            s
            for s, h in enumerate(self.holder)
            if h is not None and live[s] and self.requests[h].stop_strings
        ]
        if not watched:
            return cut
        out = np.asarray(self.state["out"])
        for slot in watched:
            strings, n = self.requests[self.holder[slot]].stop_strings, int(count[slot])
            if not any(s in self.engine.decode(out[slot, :n].tolist()) for s in strings):
                continue
            for keep in range(1, n + 1):  # the first prefix whose text holds a stop string
                if any(s in self.engine.decode(out[slot, :keep].tolist()) for s in strings):
                    cut[slot] = keep
                    break
        return cut
