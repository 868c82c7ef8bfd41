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
  ids: attention, the CCA convolutions and RoPE positions restart at each), in rows of a
  power-of-two width, about ``batch_tokens`` tokens to a forward pass, so a task compiles a few
  programs, not one per length;
- the LM head is applied only where a continuation token is scored, ``head_chunk`` of them at a
  time (with a 262,144-token vocabulary the head is most of a short forward's cost, and the whole
  logits of one 4,096-token row are 4.3 GB);
- a forward's rows are split over the given devices (data parallel; the weights replicated).

Rounding aside a packed document gets the logits it gets alone (tests/scoring/test_likelihood.py:
≤ 1e-5 against one unpadded forward per request).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zaya_jax.config import ModelConfig
from zaya_jax.model import Zaya
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


def batches(
    inputs: Sequence[tuple[tuple[int, ...], list[tuple[int, tuple[int, ...]]]]],
    batch_tokens: int,
    row_multiple: int = 1,
) -> Iterator[Batch]:
    """The forward passes that score ``inputs`` (from :func:`model_inputs`, longest first): rows
    as wide as the power of two that holds the first input, each input placed in the first row it
    fits (first-fit decreasing), until about ``batch_tokens`` tokens; the row count rounded up to
    a power of two and to a multiple of ``row_multiple`` (the devices the rows are split over)."""
    start = 0
    while start < len(inputs):
        width = max(MIN_WIDTH, _pow2(len(inputs[start][0])))
        rows = max(1, batch_tokens // width)
        free = np.full(rows, width)
        placed: list[tuple[int, int]] = []  # (row, offset) of each input of this batch
        while start + len(placed) < len(inputs):
            length = len(inputs[start + len(placed)][0])
            fits = np.flatnonzero(free >= length)
            if not len(fits):
                break
            row = int(fits[0])
            placed.append((row, width - int(free[row])))
            free[row] -= length
        used = int(max(row for row, _ in placed)) + 1
        yield _assemble(inputs[start : start + len(placed)], placed, width, _rows(used, row_multiple))
        start += len(placed)


def _rows(used: int, multiple: int) -> int:
    rows = _pow2(used)
    return -(-rows // multiple) * multiple


def _assemble(inputs, placed, width: int, rows: int) -> Batch:
    tokens = np.zeros((rows, width), np.int32)
    segment_ids = np.zeros((rows, width), np.int32)
    positions = np.zeros((rows, width), np.int32)
    queries, owners = [], []
    segments = np.zeros(rows, np.int32)
    for (ids, scored), (row, offset) in zip(inputs, placed, strict=True):
        n = len(ids)
        segments[row] += 1
        tokens[row, offset : offset + n] = ids
        segment_ids[row, offset : offset + n] = segments[row]
        positions[row, offset : offset + n] = np.arange(n)
        for index, targets in scored:
            first = offset + n - len(targets)
            owners.append((index, len(queries), len(targets)))
            queries.extend((row, first + t, target) for t, target in enumerate(targets))
    return Batch(tokens, segment_ids, positions, np.asarray(queries, np.int32).reshape(-1, 3), owners)


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
        self._program = jax.jit(functools.partial(_score, Zaya(cfg)), static_argnames="chunk")

    def score(
        self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int
    ) -> list[Likelihood]:
        """Each request's :class:`Likelihood`, in request order."""
        out: list[Likelihood | None] = [None] * len(requests)
        rows = NamedSharding(self.mesh, PartitionSpec("data"))
        for batch in batches(model_inputs(requests, max_length), self.batch_tokens, self.mesh.size):
            n = len(batch.queries)
            chunk = min(self.head_chunk, _pow2(n))
            queries = np.zeros((-(-_pow2(n) // chunk) * chunk, 3), np.int32)
            queries[:n] = batch.queries
            arrays = [jax.device_put(a, rows) for a in (batch.tokens, batch.segment_ids, batch.positions)]
            logprobs, greedy = self._program(self.variables, *arrays, queries, chunk=chunk)
            logprobs, greedy = np.asarray(logprobs, np.float64), np.asarray(greedy)
            for index, first, count in batch.owners:
                scored = slice(first, first + count)
                out[index] = Likelihood(float(logprobs[scored].sum()), bool(greedy[scored].all()))
        return out  # type: ignore[return-value]


def _score(model: Zaya, variables, tokens, segment_ids, positions, queries, *, chunk: int):
    """(logprob, greedy) of every query's target at its (row, position), the head applied to
    ``chunk`` queries at a time."""
    hidden, _ = model.apply(
        variables,
        tokens,
        token_mask=segment_ids > 0,
        segment_ids=segment_ids,
        positions=positions,
        return_hidden=True,
    )
    weight, bias, vocab_axis = lm_head_weights(model.cfg, variables["params"])
    weight = weight.astype(hidden.dtype)
    picked = hidden[queries[:, 0], queries[:, 1]].reshape(-1, chunk, hidden.shape[-1])

    def one(args):
        h, targets = args
        logits = head_logits(h[None], weight, bias, vocab_axis)[0]
        chosen = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        return chosen - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == targets

    logprobs, greedy = jax.lax.map(one, (picked, queries[:, 2].reshape(-1, chunk)))
    return logprobs.reshape(-1), greedy.reshape(-1)
