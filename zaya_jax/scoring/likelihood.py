"""Log-likelihoods of continuations, many requests to a forward pass: lm-eval's ``loglikelihood``
and ``loglikelihood_rolling`` for the ``zaya`` model (:mod:`zaya_jax.harness`).

A request is (context ids, continuation ids), scored as lm-eval's ``hf`` model scores it: the last
``max_length + 1`` tokens of context + continuation, the model reading all but the last, the
log-probabilities of the continuation's tokens summed, and whether each is the greedy choice. Not
one padded row per request, though:

- requests whose model input is the same are read once, each taking its own targets from it (a
  multiple-choice question's one-token answers share the context and all but the last token:
  ``hf``'s logits cache, for any continuation length);
- inputs are sorted longest first and packed several to a row as separate documents (segment
  ids: attention, the CCA convolutions and RoPE positions restart at each), best fit decreasing,
  in rows of a few widths (:func:`row_width`) near each input's length, about ``batch_tokens`` tokens to a forward pass,
  so a task compiles a few programs, not one per length;
- the LM head is applied only where a continuation token is scored, ``head_chunk`` of them at a
  time (with a 262,144-token vocabulary the head is most of a short forward's cost, and the whole
  logits of one 4,096-token row are 4.3 GB);
- a forward's rows are split over the given devices (data parallel; the weights replicated).

Rounding aside a packed document gets the logits it gets alone (tests/scoring/test_likelihood.py:
≤ 1e-5 against one unpadded forward per request).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zaya_jax.config import ModelConfig
from zaya_jax.model import Zaya, init_cache
from zaya_jax.model.stack import ROW_CACHE_KEYS
from zaya_jax.model.transformer import lm_head_weights
from zaya_jax.ops.cross_entropy import head_logits

MIN_WIDTH = 16
HEAD_BUDGET = 2**26
"""Float32 logits the head computes at once (256 MiB): ``head_chunk`` is this over the vocabulary."""


@dataclasses.dataclass(frozen=True)
class Likelihood:
    """A continuation's summed log-probability and whether greedy decoding gives all its tokens."""

    logprob: float
    greedy: bool


@dataclasses.dataclass(frozen=True)
class Batch:
    """One forward pass: (rows, width) ``tokens``, ``segment_ids`` (0: padding) and ``positions``;
    ``queries`` (n, 3) [row, position, target] for every scored token; ``owners`` (request, first
    query, count) for every request scored in it."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    queries: np.ndarray
    owners: list[tuple[int, int, int]]


@dataclasses.dataclass(frozen=True)
class Shared:
    """One forward pass over groups of inputs that share a prefix: (groups, width) ``prefix``
    tokens and ``prefix_n`` real ones each, read once into a decode cache; (rows, width) ``suffix``
    tokens, ``suffix_n`` real, each continuing the cache of group ``parent``; ``queries`` (n, 3)
    [suffix row, position, target] and ``owners`` as in :class:`Batch`."""

    prefix: np.ndarray
    prefix_n: np.ndarray
    parent: np.ndarray
    suffix: np.ndarray
    suffix_n: np.ndarray
    queries: np.ndarray
    owners: list[tuple[int, int, int]]


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def model_inputs(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int
) -> list[tuple[tuple[int, ...], list[tuple[int, tuple[int, ...]]]]]:
    """Each distinct model input (the last ``max_length + 1`` tokens of context + continuation but
    its last) with the requests it scores (index, targets: the last tokens of the input's next
    tokens), longest first."""
    by_input: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = {}
    for index, (context, continuation) in enumerate(requests):
        if not context or not continuation:
            raise ValueError(
                f"request {index} has an empty {'context' if not context else 'continuation'}; "
                "score an empty context after a prefix token (the tokenizer's BOS), as lm-eval does"
            )
        if len(continuation) > max_length:
            raise ValueError(
                f"request {index}'s continuation has {len(continuation)} tokens, more than max_length="
                f"{max_length}; raise max_length or score it in windows (loglikelihood_rolling)"
            )
        whole = [*context, *continuation][-(max_length + 1) :]
        by_input.setdefault(tuple(whole[:-1]), []).append((index, tuple(whole[-len(continuation) :])))
    return sorted(by_input.items(), key=lambda item: (-len(item[0]), item[0]))


def row_width(length: int, minimum: int = MIN_WIDTH) -> int:
    """The row a ``length``-token input opens: ``length`` rounded up to a quarter of its power of
    two (..., 96, 112, 128, 160, 192, 224, 256, 320, ...), at least ``minimum``: a few programs per
    doubling of the length, at most a fifth of a row left over where nothing shorter fills it."""
    step = max(minimum // 4, _pow2(length) // 8, 1)
    return max(minimum, -(-length // step) * step)


def batches(
    inputs: Sequence[tuple[tuple[int, ...], list[tuple[int, tuple[int, ...]]]]],
    batch_tokens: int,
    row_multiple: int = 1,
) -> Iterator[Batch]:
    """The forward passes that score ``inputs`` (from :func:`model_inputs`, longest first).

    Each input goes to the fullest row whose free tokens hold it (best fit decreasing), else opens
    a row of its :func:`row_width` (narrow rows: attention costs grow with the width); rows of one
    width go to a forward pass together, about ``batch_tokens`` tokens at a time, a forward's rows
    rounded up to a power of two and to a multiple of ``row_multiple`` (the devices the rows are
    split over)."""
    rows: list[list[int]] = []
    widths: list[int] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for i, (ids, _) in enumerate(inputs):
        k = bisect.bisect_left(free, (len(ids), -1))
        if k < len(free):
            room, row = free.pop(k)
            rows[row].append(i)
        else:
            row, room = len(rows), row_width(len(ids))
            rows.append([i])
            widths.append(room)
        bisect.insort(free, (room - len(ids), row))
    by_width: dict[int, list[list[int]]] = {}
    for members, width in zip(rows, widths, strict=True):
        by_width.setdefault(width, []).append(members)
    for width in sorted(by_width, reverse=True):
        same = by_width[width]
        per_forward = _pow2(max(1, batch_tokens // width) + 1) // 2  # a power of two at most
        for start in range(0, len(same), per_forward):
            chunk = same[start : start + per_forward]
            yield _assemble(inputs, chunk, width, _rows(len(chunk), row_multiple))


def _rows(used: int, multiple: int) -> int:
    rows = _pow2(used)
    return -(-rows // multiple) * multiple


def _assemble(inputs, rows: list[list[int]], width: int, height: int) -> Batch:
    tokens = np.zeros((height, width), np.int32)
    segment_ids = np.zeros((height, width), np.int32)
    positions = np.zeros((height, width), np.int32)
    queries, owners = [], []
    for row, members in enumerate(rows):
        offset = 0
        for segment, i in enumerate(members, start=1):
            ids, scored = inputs[i]
            n = len(ids)
            tokens[row, offset : offset + n] = ids
            segment_ids[row, offset : offset + n] = segment
            positions[row, offset : offset + n] = np.arange(n)
            for index, targets in scored:
                first = offset + n - len(targets)
                owners.append((index, len(queries), len(targets)))
                queries.extend((row, first + t, target) for t, target in enumerate(targets))
            offset += n
    return Batch(tokens, segment_ids, positions, np.asarray(queries, np.int32).reshape(-1, 3), owners)


def plan(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    max_length: int,
    batch_tokens: int,
    row_multiple: int = 1,
) -> Iterator[Batch | Shared]:
    """Every forward pass that scores ``requests``: inputs that share their prefix with another
    (everything before their scored positions, at least :data:`MIN_WIDTH` tokens: the choices of a
    multiple-choice question) as :class:`Shared` passes, the prefix read once; the rest packed
    (:func:`batches`)."""
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], list]]] = {}
    for ids, owners in model_inputs(requests, max_length):
        scored = max(len(targets) for _, targets in owners)
        groups.setdefault(ids[:-scored], []).append((ids[-scored:], owners))
    shared, alone = [], []
    for prefix, members in groups.items():
        if len(members) > 1 and len(prefix) >= MIN_WIDTH:
            shared.append((prefix, members))
        else:
            alone += [(prefix + tail, owners) for tail, owners in members]
    yield from batches(sorted(alone, key=lambda item: (-len(item[0]), item[0])), batch_tokens, row_multiple)
    yield from shared_batches(sorted(shared, key=lambda g: (-len(g[0]), g[0])), batch_tokens, row_multiple)


def shared_batches(groups, batch_tokens: int, row_multiple: int = 1) -> Iterator[Shared]:
    """Groups (prefix, [(suffix, owners)]), longest prefix first, to forward passes of about
    ``batch_tokens`` tokens (prefixes and suffixes together): a power of two of groups each (no
    empty prefix rows) but the last, at least one."""
    start = 0
    while start < len(groups):
        prefix_width, rows, taken = row_width(len(groups[start][0])), 0, 0
        while start + taken < len(groups):
            rows += len(groups[start + taken][1])
            if taken and (taken + 1) * prefix_width + rows * MIN_WIDTH > batch_tokens:
                break
            taken += 1
        if start + taken < len(groups):
            taken = _pow2(taken + 1) // 2
        chunk = groups[start : start + taken]
        suffixes = [tail for _, members in chunk for tail, _ in members]
        suffix_width = row_width(max(map(len, suffixes)), minimum=4)
        yield _assemble_shared(chunk, prefix_width, suffix_width, len(suffixes), row_multiple)
        start += taken


def _assemble_shared(groups, prefix_width: int, suffix_width: int, rows: int, multiple: int) -> Shared:
    height = _rows(len(groups), multiple)
    prefix, prefix_n = np.zeros((height, prefix_width), np.int32), np.zeros(height, np.int32)
    height = _rows(rows, multiple)
    suffix, suffix_n = np.zeros((height, suffix_width), np.int32), np.zeros(height, np.int32)
    parent = np.zeros(height, np.int32)
    queries, owners, row = [], [], 0
    for group, (ids, members) in enumerate(groups):
        prefix[group, : len(ids)], prefix_n[group] = ids, len(ids)
        for tail, scored in members:
            suffix[row, : len(tail)], suffix_n[row], parent[row] = tail, len(tail), group
            for index, targets in scored:
                first = len(tail) - len(targets)
                owners.append((index, len(queries), len(targets)))
                queries.extend((row, first + t, target) for t, target in enumerate(targets))
            row += 1
    queries = np.asarray(queries, np.int32).reshape(-1, 3)
    return Shared(prefix, prefix_n, parent, suffix, suffix_n, queries, owners)


class LikelihoodScorer:
    """Scores (context, continuation) token requests with a model's ``variables``, the rows of
    each forward pass split over ``devices`` (default: this process's)."""

    def __init__(
        self,
        cfg: ModelConfig,
        variables: dict[str, Any],
        *,
        batch_tokens: int = 4096,
        devices: Sequence[jax.Device] | None = None,
    ):
        if batch_tokens < MIN_WIDTH:
            raise ValueError(f"batch_tokens={batch_tokens} must be at least {MIN_WIDTH}")
        if cfg.moe_impl == "capacity":  # capacity drops tokens by what shares the batch: never here
            cfg = dataclasses.replace(cfg, moe_impl="sorted")
        self.cfg, self.batch_tokens = cfg, batch_tokens
        self.mesh = Mesh(np.asarray(devices or jax.local_devices()), ("data",))
        self.variables = jax.device_put(variables, NamedSharding(self.mesh, PartitionSpec()))
        self.head_chunk = max(1, HEAD_BUDGET // cfg.vocab_size)
        model = Zaya(cfg)
        self._packed = jax.jit(functools.partial(_packed, model), static_argnames="chunk")
        self._shared = jax.jit(functools.partial(_shared, model), static_argnames="chunk")

    def score(
        self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int
    ) -> list[Likelihood]:
        """Each request's :class:`Likelihood`, in request order."""
        out: list[Likelihood | None] = [None] * len(requests)
        rows = NamedSharding(self.mesh, PartitionSpec("data"))
        for batch in plan(requests, max_length, self.batch_tokens, self.mesh.size):
            n = len(batch.queries)
            chunk = min(self.head_chunk, _pow2(n))
            queries = np.zeros((-(-_pow2(n) // chunk) * chunk, 3), np.int32)
            queries[:n] = batch.queries
            if isinstance(batch, Batch):
                arrays = (batch.tokens, batch.segment_ids, batch.positions)
                program = self._packed
            else:
                arrays = (batch.prefix, batch.prefix_n, batch.parent, batch.suffix, batch.suffix_n)
                program = self._shared
            arrays = [jax.device_put(a, rows) for a in arrays]
            logprobs, greedy = program(self.variables, *arrays, queries, chunk=chunk)
            logprobs, greedy = np.asarray(logprobs, np.float64), np.asarray(greedy)
            for index, first, count in batch.owners:
                scored = slice(first, first + count)
                out[index] = Likelihood(float(logprobs[scored].sum()), bool(greedy[scored].all()))
        return out  # type: ignore[return-value]


def _packed(model: Zaya, variables, tokens, segment_ids, positions, queries, *, chunk: int):
    """(logprob, greedy) of every query's target at its (row, position) of packed rows."""
    hidden, _ = model.apply(
        variables,
        tokens,
        token_mask=segment_ids > 0,
        segment_ids=segment_ids,
        positions=positions,
        return_hidden=True,
    )
    return _query_logprobs(model.cfg, variables, hidden, queries, chunk)


def _shared(model: Zaya, variables, prefix, prefix_n, parent, suffix, suffix_n, queries, *, chunk: int):
    """(logprob, greedy) of every query of the suffix rows, each continuing its group's prefix:
    the prefixes read into a decode cache, each row's copy of its group's cache continued."""
    groups, prefix_width = prefix.shape
    suffix_width = suffix.shape[1]
    cache = init_cache(model.cfg, groups, prefix_width + suffix_width, per_row=True, window_caches=False)
    mask = (jnp.arange(prefix_width)[None] < prefix_n[:, None]).astype(jnp.int32)
    _, aux = model.apply(variables, prefix, token_mask=mask, cache=cache, return_hidden=True)
    cache = {k: jnp.take(x, parent, axis=0 if k in ROW_CACHE_KEYS else 1) for k, x in aux["cache"].items()}
    mask = (jnp.arange(suffix_width)[None] < suffix_n[:, None]).astype(jnp.int32)
    hidden, _ = model.apply(variables, suffix, token_mask=mask, cache=cache, return_hidden=True)
    return _query_logprobs(model.cfg, variables, hidden, queries, chunk)


def _query_logprobs(cfg: ModelConfig, variables, hidden, queries, chunk: int):
    """The LM head at each query's (row, position) of ``hidden``, ``chunk`` queries at a time:
    (log-probability of its target, whether the target is the argmax)."""
    weight, bias, vocab_axis = lm_head_weights(cfg, variables["params"])
    weight = weight.astype(hidden.dtype)
    picked = hidden[queries[:, 0], queries[:, 1]].reshape(-1, chunk, hidden.shape[-1])

    def one(args):
        h, targets = args
        logits = head_logits(h[None], weight, bias, vocab_axis)[0]
        chosen = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        return chosen - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == targets

    logprobs, greedy = jax.lax.map(one, (picked, queries[:, 2].reshape(-1, chunk)))
    return logprobs.reshape(-1), greedy.reshape(-1)
