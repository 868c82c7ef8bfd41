"""Grain input pipelines: tokenized sources -> shuffled, packed rows -> weighted mixture -> batches.

Documents come from :mod:`zaya_jax.data.documents`, rows from :mod:`zaya_jax.data.packing`, and
:mod:`zaya_jax.data.prefetch` runs the batch producer ahead of training.

Per source: ``grain.MapDataset`` over its documents -> this stream's share (``[k::S]``, see
:mod:`zaya_jax.data.streams`) ->
``shuffle`` (seeded; ``repeat`` reseeds it, so every epoch is a new permutation) -> ``repeat`` ->
``to_iter_dataset`` -> :class:`PackIterDataset` -> ``grain.experimental.WindowShuffleIterDataset``
(``data.shuffle_window`` rows; training only). :class:`RowIterator` interleaves the sources' rows
by weight; :func:`next_batch` stacks rows into a batch, so the batch size may change between steps.

Why the row shuffle: packing emits a long document's rows one after another, so without it a
batch of 16 rows is 2 KB of one source file and consecutive steps walk through the same file. The
model then fits the file it is in (train loss 1.33 nats/byte against 1.83 held-out in the ``tiny``
run); rows drawn from a window of thousands make each batch a sample of many documents.

Why :class:`RowIterator` and not Grain's ``IterDataset.mix``: a curriculum stage changes the mixture
and the sequence length mid-run while every source continues from its own position; a Grain mixture
is fixed when built and its state belongs to that one dataset. The mixer here is a few lines of
deficit counting whose state (row counts) is saved beside each source's Grain state.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from zaya_jax.config import ConfigError, DataConfig
from zaya_jax.data.documents import SourceDocuments, Split, tokenized_documents
from zaya_jax.data.packing import packed_rows, source_seed
from zaya_jax.data.sources import DataError
from zaya_jax.data.tokenizers import Tokenizer

STATE_VERSION = 2  # 2: documents split by data stream, not by process


def _normalise(weights: Sequence[float], names: Sequence[str]) -> list[float]:
    if len(weights) != len(names):
        raise ConfigError(
            f"the mixture has {len(weights)} weights for {len(names)} data sources {list(names)}; "
            "give one weight per source, in data.sources order"
        )
    w = [float(x) for x in weights]
    if not all(math.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        raise ConfigError(
            f"mixture weights {list(weights)} must be >= 0 with a positive sum (0 leaves a source out)"
        )
    return [x / sum(w) for x in w]


class RowIterator:
    """Infinite iterator of packed rows (dicts of (seq_len,) arrays, see the module doc).

    Sources are interleaved deterministically by weight: the next row comes from the source that is
    furthest below its share of the rows since the mixture was set, so a 3:1 mixture gives exactly 3
    rows of one per row of the other in every 4 (rows are full, so this is also the token share).

    ``get_state()`` is a small JSON-able dict: each source's Grain state (position in its shuffled,
    repeated document order plus the offset inside the current document) and the mixer's row counts.
    ``set_state`` on an iterator built from the same data, seed and stream continues exactly
    where the saved one stopped. ``seq_len`` and the mixture may differ (a curriculum stage change):
    sources then continue from their saved documents and the new mixture starts fresh; with a row
    window shuffle (``shuffle_window``) the saved window is refilled at the new length from its
    start, so up to one window of tokens is seen again.
    """

    def __init__(
        self,
        sources: Sequence[SourceDocuments],
        *,
        seq_len: int,
        seed: int,
        eos_id: int,
        pad_id: int,
        mixture: Sequence[float] | None = None,
        shuffle: bool = True,
        repeat: bool = True,
        split: Split = "train",
        stream: int = 0,
        streams: int = 1,
        shuffle_window: int = 0,
    ):
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be >= 1")
        if not 0 <= stream < streams:
            raise ValueError(f"stream={stream} must be in [0, streams={streams})")
        self.seq_len = seq_len
        self.names = [s.name for s in sources]
        self._fingerprint = {
            "split": split,
            "seed": seed,
            "shuffle": shuffle,
            "repeat": repeat,
            "shuffle_window": shuffle_window,
            "stream": stream,
            "streams": streams,
            "sources": {s.name: s.fingerprint for s in sources},
        }
        self._iterators = [
            packed_rows(
                s.documents,
                seq_len=seq_len,
                eos_id=eos_id,
                pad_id=pad_id,
                seed=source_seed(seed, s.name if streams == 1 else f"{s.name}/{stream}"),
                shuffle=shuffle,
                repeat=repeat,
                stream=stream,
                streams=streams,
                shuffle_window=shuffle_window,
                name=s.name,
                num_tokens=s.num_tokens,
            ).__iter__()
            for s in sources
        ]
        self._exhausted = [False] * len(sources)
        self.set_mixture([s.weight for s in sources] if mixture is None else mixture)

    def set_mixture(self, weights: Sequence[float]) -> None:
        """Change the source weights (a curriculum stage); sources keep their positions."""
        self._weights = _normalise(weights, self.names)
        self._counts = [0] * len(self.names)

    @property
    def mixture(self) -> tuple[float, ...]:
        return tuple(self._weights)

    def __iter__(self) -> RowIterator:
        return self

    def _pick(self) -> int | None:
        """The active source furthest below its share of the rows so far (ties: the first)."""
        active = [0.0 if done else w for w, done in zip(self._weights, self._exhausted, strict=True)]
        total = sum(active)
        if total <= 0:
            return None
        rows = sum(self._counts) + 1
        best, best_deficit = None, -math.inf
        for i, w in enumerate(active):
            if w > 0 and (deficit := w / total * rows - self._counts[i]) > best_deficit:
                best, best_deficit = i, deficit
        return best

    def __next__(self) -> dict[str, np.ndarray]:
        while (i := self._pick()) is not None:
            try:
                row = next(self._iterators[i])
            except StopIteration:  # only when repeat=False: a finite source ran out
                self._exhausted[i] = True
                continue
            self._counts[i] += 1
            return row
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        """The position of this iterator as a JSON-able dict (see the class doc)."""
        return {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint,
            "sources": {name: it.get_state() for name, it in zip(self.names, self._iterators, strict=True)},
            "mixture": {"weights": list(self._weights), "counts": list(self._counts)},
            "exhausted": list(self._exhausted),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a state of :meth:`get_state` (possibly from another process lifetime)."""
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"data iterator state version {state.get('version')!r} is not {STATE_VERSION}; it was saved "
                "by another zaya-jax version: restart the data from the beginning"
            )
        saved = state["fingerprint"]
        for key, value in self._fingerprint.items():
            if saved.get(key) != value:
                raise DataError(
                    f"the saved data iterator state has {key}={saved.get(key)!r} but this iterator has "
                    f"{key}={value!r}: the data, seed or data.streams changed since the checkpoint, so its "
                    "data position does not apply; restore with the original data and settings"
                )
        for name, it in zip(self.names, self._iterators, strict=True):
            it.set_state(state["sources"][name])
        self._exhausted = list(state["exhausted"])
        mixture = state["mixture"]
        same_mixture = [float(w) for w in mixture["weights"]] == self._weights
        self._counts = [int(c) for c in mixture["counts"]] if same_mixture else [0] * len(self.names)


def make_row_iterator(
    data_cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    seed: int,
    mixture: tuple[float, ...] | None = None,
    split: Split = "train",
    stream: int = 0,
    streams: int = 1,
    shuffle: bool = True,
    repeat: bool = True,
    references: Mapping[str, np.ndarray] | None = None,
) -> RowIterator:
    """Packed rows of ``seq_len`` from the sources of ``data_cfg`` (see :class:`RowIterator`);
    training rows are shuffled within windows of ``data_cfg.shuffle_window`` rows. ``references``:
    the reference log-probabilities of preference sources (:func:`~zaya_jax.data.documents.tokenized_documents`).

    ``mixture``: one weight per source (default: each source's ``weight``). Stream ``k`` of
    ``streams`` reads documents ``k, k + streams, ...`` of every source, disjoint from the other
    streams (training builds its batches from several, :mod:`zaya_jax.data.streams`).
    ``shuffle=False`` keeps document order (tests, inspection); ``repeat=False`` ends after one epoch.
    For ``split="held_out"`` sources without held-out documents are left out (small sources may
    have none); for training every source must have documents.
    """
    return stream_rows_of(
        tokenized_documents(data_cfg, split, tokenizer, references),
        tokenizer,
        seq_len=seq_len,
        seed=seed,
        mixture=mixture,
        split=split,
        stream=stream,
        streams=streams,
        shuffle=shuffle,
        repeat=repeat,
        shuffle_window=data_cfg.shuffle_window if split == "train" else 0,
    )


def stream_rows_of(
    sources: list[SourceDocuments],
    tokenizer: Tokenizer,
    *,
    mixture: Sequence[float] | None,
    split: Split,
    streams: int = 1,
    **kwargs: Any,
) -> RowIterator:
    """One stream's :class:`RowIterator` over already tokenized ``sources`` (held-out sources
    without documents left out; a training source with fewer documents than streams refused)."""
    weights = [s.weight for s in sources] if mixture is None else list(mixture)
    _normalise(weights, [s.name for s in sources])
    kept = []
    for source, weight in zip(sources, weights, strict=True):
        available = len(source.documents)
        if available >= streams:
            kept.append((source, weight))
        elif split != "held_out":
            raise DataError(
                f"data source {source.name!r} has {available} {split} documents, fewer than the "
                f"{streams} data streams reading it; add documents (each stream needs at least one) or "
                f"set data.streams <= {max(available, 1)}"
                + (" or lower data.held_out_fraction" if split == "train" else "")
            )
    if not kept:
        raise DataError(
            "no data source has held-out documents; add documents or raise data.held_out_fraction"
        )
    return RowIterator(
        [s for s, _ in kept],
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        mixture=[w for _, w in kept],
        split=split,
        streams=streams,
        **kwargs,
    )


def next_batch(rows: Iterator[dict[str, np.ndarray]], batch_size: int) -> dict[str, np.ndarray]:
    """Pull ``batch_size`` rows and stack them: each key -> (batch_size, seq_len)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    taken = [next(rows) for _ in range(batch_size)]
    return {key: np.stack([row[key] for row in taken]) for key in taken[0]}


def eval_batches(
    data_cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    seed: int = 0,
    references: Mapping[str, np.ndarray] | None = None,
) -> list[dict[str, np.ndarray]]:
    """``num_batches`` fixed batches of held-out rows (the same on every call with the same
    arguments), each key (batch_size, seq_len). When the held-out documents hold fewer pairs than
    requested, rows repeat (with a warning)."""
    sources = tokenized_documents(data_cfg, "held_out", tokenizer, references)
    rows = stream_rows_of(sources, tokenizer, seq_len=seq_len, seed=seed, mixture=None, split="held_out")
    known = [s.num_tokens for s in sources if s.num_tokens is not None]
    wanted = num_batches * batch_size * seq_len
    if len(known) == len(sources) and sum(known) < wanted:
        warnings.warn(
            f"the held-out split has {sum(known)} tokens but {num_batches} eval batches of "
            f"{batch_size}x{seq_len} need {wanted}; evaluation repeats rows (lower eval.batches or "
            "raise data.held_out_fraction)",
            stacklevel=2,
        )
    return [next_batch(rows, batch_size) for _ in range(num_batches)]
