"""Grain input pipelines: tokenized sources -> shuffled, packed rows -> weighted mixture -> batches.

Per source: ``grain.MapDataset`` over its documents -> this process's share (``[p::P]``) ->
``shuffle`` (seeded; ``repeat`` reseeds it, so every epoch is a new permutation) -> ``repeat`` ->
``to_iter_dataset`` -> :class:`PackIterDataset` -> ``grain.experimental.WindowShuffleIterDataset``
(``data.shuffle_window`` rows; training only). :class:`RowIterator` interleaves the sources' rows
by weight; :func:`next_batch` stacks rows into a batch, so the batch size may change between steps.

Why the row shuffle: packing emits a long document's rows one after another, so without it a
batch of 16 rows is 2 KB of one source file and consecutive steps walk through the same file. The
model then fits the file it is in (train loss 1.33 nats/byte against 1.83 held-out in the ``tiny``
run); rows drawn from a window of thousands make each batch a sample of many documents.

Row format (every array has length ``seq_len``):

- ``inputs`` int32, ``targets`` int32: every document gets EOS appended, and a document of ``n``
  tokens contributes the ``n`` pairs (token ``t``, token ``t+1``), the last one (last token, EOS).
  Pairs are packed greedily: a row is filled to exactly ``seq_len`` pairs from consecutive
  documents, and a document that does not fit continues in the next row, starting with the pair
  after the last one placed (no pair is lost or repeated, and a target never crosses into another
  document). EOS is never an input (what follows it is another document).
- ``segment_ids`` int32: 1, 2, 3 ... for the documents (or document pieces) of the row; 0 = padding.
- ``positions`` int32: the index within the row's segment, restarting at 0 in every segment, also for
  a continued document: equal to ``zaya_jax.model.positions_in_document(segment_ids)``, the model's
  default, and RoPE only sees relative positions, which are the same either way.
- ``loss_mask`` float32: 1 on every real pair, 0 on padding. Rows of an infinite (training) stream
  are always full; only the last row of a finite stream is padded.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import queue
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar

import grain
import numpy as np

from zaya_jax.config import ConfigError, DataConfig, DataSource
from zaya_jax.data import corpus
from zaya_jax.data.prepare import PreparedDocuments, open_prepared
from zaya_jax.data.sources import DataError, file_signature, read_documents
from zaya_jax.data.tokenizers import Tokenizer

Split = Literal["train", "held_out", "all"]
ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
STATE_VERSION = 1
# Synchronous reads: documents are in memory or a local ArrayRecord read of ~10 us, and the
# Prefetcher thread already overlaps the whole pipeline with the training step.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
_CACHE_ENTRIES = 8
T = TypeVar("T")


class DocumentSequence(Protocol):
    """Random access to token documents: ``docs[i]`` -> (num_tokens,) integer array."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


class TokenizedDocuments:
    """Documents in memory: document ``i`` is ``tokens[starts[i]:ends[i]]``; a selection of
    documents shares the one ``tokens`` array."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        self.tokens = tokens
        self.starts = starts
        self.ends = ends

    def select(self, indices: np.ndarray) -> TokenizedDocuments:
        return TokenizedDocuments(self.tokens, self.starts[indices], self.ends[indices])

    @property
    def num_tokens(self) -> int:
        return int((self.ends - self.starts).sum())

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[self.starts[index] : self.ends[index]]


class DocumentSubset:
    """The documents ``indices`` of a random-access ``base`` (a split of prepared shards)."""

    def __init__(self, base: DocumentSequence, indices: np.ndarray):
        self.base = base
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.base[int(self.indices[index])]


@dataclasses.dataclass(frozen=True)
class SourceDocuments:
    """One source's documents of one split. ``fingerprint`` names the exact contents (a restored
    iterator state must come from the same data); ``num_tokens`` is None when unknown without
    reading every document (a split of prepared shards); ``skipped`` bad documents were left out."""

    name: str
    weight: float
    documents: DocumentSequence
    fingerprint: str
    num_tokens: int | None
    skipped: int


@dataclasses.dataclass
class _Tokenized:
    """A cached tokenized source: all documents, their split keys, and split masks per fraction."""

    documents: TokenizedDocuments
    keys: list[str]
    skipped: int
    held_out: dict[float, np.ndarray] = dataclasses.field(default_factory=dict)

    def mask(self, fraction: float) -> np.ndarray:
        if fraction not in self.held_out:
            self.held_out[fraction] = np.fromiter(
                (corpus.held_out_key(k, fraction) for k in self.keys), dtype=bool, count=len(self.keys)
            )
        return self.held_out[fraction]


# Tokenized text sources of this process (the stdlib tokenizes in about a second, but every eval
# and every stage change asks again), least recently used last.
_CACHE: collections.OrderedDict[str, _Tokenized] = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()


def _tokenize_source(source: DataSource, tokenizer: Tokenizer, on_bad_document: str) -> _Tokenized:
    cache_key = json.dumps(
        [
            source.kind,
            source.path,
            source.text_field,
            tokenizer.spec,
            on_bad_document,
            file_signature(source),
        ]
    )
    with _CACHE_LOCK:
        if cache_key in _CACHE:
            _CACHE.move_to_end(cache_key)
            return _CACHE[cache_key]
    docs = read_documents(source, on_bad_document)  # type: ignore[arg-type]
    tokens, lengths = tokenizer.encode_concatenated(docs.texts)
    ends = np.cumsum(lengths)
    everything = TokenizedDocuments(tokens, ends - lengths, ends)
    # A document the tokenizer maps to nothing carries no pair to learn from.
    kept = np.flatnonzero(lengths)
    entry = _Tokenized(everything.select(kept), [docs.keys[i] for i in kept], docs.skipped)
    with _CACHE_LOCK:
        _CACHE[cache_key] = entry
        while len(_CACHE) > _CACHE_ENTRIES:
            _CACHE.popitem(last=False)
    return entry


def _split_indices(held_out: np.ndarray, split: Split) -> np.ndarray:
    if split == "all":
        return np.arange(len(held_out))
    if split == "held_out":
        return np.flatnonzero(held_out)
    if split == "train":
        return np.flatnonzero(~held_out)
    raise ValueError(f"split={split!r}; use 'train', 'held_out' or 'all'")


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def tokenized_documents(data_cfg: DataConfig, split: Split, tokenizer: Tokenizer) -> list[SourceDocuments]:
    """Every source of ``data_cfg`` as the token documents of ``split``, in config order.

    Text sources (stdlib, text, JSONL, Parquet) are read and tokenized once per process and cached;
    prepared ArrayRecord sources are opened (verified) and read lazily. The held-out split hashes
    each document's key (:mod:`zaya_jax.data.corpus`), so the splits never share a document.
    """
    fraction = data_cfg.held_out_fraction
    out = []
    for source in data_cfg.sources:
        if source.kind == "arrayrecord":
            if not source.path:
                raise DataError(f"data source {source.name!r} of kind 'arrayrecord' needs a path")
            prepared: PreparedDocuments = open_prepared(source.path, tokenizer)
            indices = _split_indices(corpus.held_out_indices(len(prepared), fraction), split)
            documents: DocumentSequence = DocumentSubset(prepared, indices)
            fingerprint = _digest(prepared.fingerprint(), split, fraction)
            num_tokens = prepared.num_tokens if split == "all" else None
            skipped = int(prepared.manifest.get("skipped_documents", 0))
        else:
            entry = _tokenize_source(source, tokenizer, data_cfg.on_bad_document)
            selected = entry.documents.select(_split_indices(entry.mask(fraction), split))
            documents, num_tokens, skipped = selected, selected.num_tokens, entry.skipped
            fingerprint = _digest(
                source.kind, len(entry.documents), entry.documents.num_tokens, split, fraction
            )
        out.append(SourceDocuments(source.name, source.weight, documents, fingerprint, num_tokens, skipped))
    return out


# ---------------------------------------------------------------------------------------------
# Packing


def _empty_row(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    return {
        "inputs": np.full(seq_len, pad_id, np.int32),
        "targets": np.full(seq_len, pad_id, np.int32),
        "segment_ids": np.zeros(seq_len, np.int32),
        "positions": np.zeros(seq_len, np.int32),
        "loss_mask": np.zeros(seq_len, np.float32),
    }


class _PackDatasetIterator(grain.DatasetIterator):
    """Greedy concat-then-split packing of (document + EOS) pairs into rows (see module doc).

    Checkpoint state: the parent's state *before* the document being packed, plus how many of its
    pairs are already placed; restoring re-reads that one document, so the state stays small.
    """

    def __init__(self, parent: grain.DatasetIterator, seq_len: int, eos_id: int, pad_id: int):
        super().__init__(parent)
        self._seq_len = seq_len
        self._eos = np.asarray([eos_id], np.int32)
        self._pad_id = pad_id
        self._doc: np.ndarray | None = None  # the current document + EOS, int32
        self._doc_state: dict[str, Any] = self._parent.get_state()
        self._offset = 0  # pairs of the current document already placed

    def _load(self, document: np.ndarray) -> None:
        self._doc = np.concatenate([np.asarray(document, np.int32), self._eos]) if len(document) else None
        self._offset = 0

    def __next__(self) -> dict[str, np.ndarray]:
        row = _empty_row(self._seq_len, self._pad_id)
        filled = 0
        segment = 0
        while filled < self._seq_len:
            if self._doc is None or self._offset >= len(self._doc) - 1:
                state = self._parent.get_state()
                try:
                    document = next(self._parent)
                except StopIteration:
                    self._doc = None
                    if filled:
                        return row  # the last row of a finite stream, padded
                    raise
                self._doc_state = state
                self._load(document)
                continue
            doc, start = self._doc, self._offset
            take = min(len(doc) - 1 - start, self._seq_len - filled)
            end = filled + take
            segment += 1
            row["inputs"][filled:end] = doc[start : start + take]
            row["targets"][filled:end] = doc[start + 1 : start + take + 1]
            row["segment_ids"][filled:end] = segment
            row["positions"][filled:end] = np.arange(take, dtype=np.int32)
            row["loss_mask"][filled:end] = 1.0
            self._offset += take
            filled = end
        return row

    def get_state(self) -> dict[str, Any]:
        if self._doc is None:
            return {"parent": self._parent.get_state(), "offset": 0, "has_document": False}
        return {"parent": self._doc_state, "offset": self._offset, "has_document": True}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._doc_state = state["parent"]
        self._doc = None
        self._offset = 0
        if state["has_document"]:
            self._load(next(self._parent))
            self._offset = int(state["offset"])


class PackIterDataset(grain.IterDataset):
    """Rows of exactly ``seq_len`` (input, target) pairs from a dataset of token documents."""

    def __init__(self, parent: grain.IterDataset, *, seq_len: int, eos_id: int, pad_id: int):
        super().__init__(parent)
        self._seq_len = seq_len
        self._eos_id = eos_id
        self._pad_id = pad_id

    def __iter__(self) -> _PackDatasetIterator:
        return _PackDatasetIterator(self._parent.__iter__(), self._seq_len, self._eos_id, self._pad_id)

    def __str__(self) -> str:
        return f"PackIterDataset(seq_len={self._seq_len})"


def _source_seed(seed: int, name: str) -> int:
    """A per-source shuffle seed; named, so adding a source does not reshuffle the others."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=4).digest(), "little")


def packed_rows(
    documents: DocumentSequence,
    *,
    seq_len: int,
    eos_id: int,
    pad_id: int,
    seed: int,
    shuffle: bool = True,
    repeat: bool = True,
    process_index: int = 0,
    process_count: int = 1,
    shuffle_window: int = 0,
) -> grain.IterDataset:
    """One source's pipeline: this process's documents, shuffled per epoch, packed into rows, the
    rows shuffled within windows of ``shuffle_window`` (0 or 1: in packing order)."""
    ds = grain.MapDataset.source(documents)
    if process_count > 1:
        ds = ds[process_index::process_count]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if repeat:
        ds = ds.repeat()
    rows = PackIterDataset(ds.to_iter_dataset(_READ_OPTIONS), seq_len=seq_len, eos_id=eos_id, pad_id=pad_id)
    if shuffle and shuffle_window > 1:
        rows = grain.experimental.WindowShuffleIterDataset(rows, window_size=shuffle_window, seed=seed)
    return rows


# ---------------------------------------------------------------------------------------------
# Rows and batches


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
    ``set_state`` on an iterator built from the same data, seed and process layout continues exactly
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
        process_index: int = 0,
        process_count: int = 1,
        shuffle_window: int = 0,
    ):
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be >= 1")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
        self.seq_len = seq_len
        self.names = [s.name for s in sources]
        self._fingerprint = {
            "split": split,
            "seed": seed,
            "shuffle": shuffle,
            "repeat": repeat,
            "shuffle_window": shuffle_window,
            "process_index": process_index,
            "process_count": process_count,
            "sources": {s.name: s.fingerprint for s in sources},
        }
        self._iterators = [
            packed_rows(
                s.documents,
                seq_len=seq_len,
                eos_id=eos_id,
                pad_id=pad_id,
                seed=_source_seed(seed, s.name),
                shuffle=shuffle,
                repeat=repeat,
                process_index=process_index,
                process_count=process_count,
                shuffle_window=shuffle_window,
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
                    f"{key}={value!r}: the data, seed or process layout changed since the checkpoint, so its "
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
    process_index: int = 0,
    process_count: int = 1,
    shuffle: bool = True,
    repeat: bool = True,
) -> RowIterator:
    """Packed rows of ``seq_len`` from the sources of ``data_cfg`` (see :class:`RowIterator`);
    training rows are shuffled within windows of ``data_cfg.shuffle_window`` rows.

    ``mixture``: one weight per source (default: each source's ``weight``). Process ``p`` of
    ``process_count`` reads documents ``p, p + P, ...`` of every source, disjoint from the others.
    ``shuffle=False`` keeps document order (tests, inspection); ``repeat=False`` ends after one epoch.
    For ``split="held_out"`` sources without held-out documents are left out (small sources may
    have none); for training every source must have documents.
    """
    return _rows(
        tokenized_documents(data_cfg, split, tokenizer),
        tokenizer,
        seq_len=seq_len,
        seed=seed,
        mixture=mixture,
        split=split,
        process_index=process_index,
        process_count=process_count,
        shuffle=shuffle,
        repeat=repeat,
        shuffle_window=data_cfg.shuffle_window if split == "train" else 0,
    )


def _rows(
    sources: list[SourceDocuments],
    tokenizer: Tokenizer,
    *,
    mixture: Sequence[float] | None,
    split: Split,
    process_count: int,
    **kwargs: Any,
) -> RowIterator:
    weights = [s.weight for s in sources] if mixture is None else list(mixture)
    _normalise(weights, [s.name for s in sources])
    kept = []
    for source, weight in zip(sources, weights, strict=True):
        available = len(source.documents)
        if available >= process_count:
            kept.append((source, weight))
        elif split != "held_out":
            raise DataError(
                f"data source {source.name!r} has {available} {split} documents, fewer than the "
                f"{process_count} processes reading it; add documents (each process needs at least one)"
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
        process_count=process_count,
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
) -> list[dict[str, np.ndarray]]:
    """``num_batches`` fixed batches of held-out rows (the same on every call with the same
    arguments), each key (batch_size, seq_len). When the held-out documents hold fewer pairs than
    requested, rows repeat (with a warning)."""
    sources = tokenized_documents(data_cfg, "held_out", tokenizer)
    rows = _rows(
        sources,
        tokenizer,
        seq_len=seq_len,
        seed=seed,
        mixture=None,
        split="held_out",
        process_index=0,
        process_count=1,
    )
    known = [s.num_tokens for s in sources if s.num_tokens is not None]
    wanted = num_batches * batch_size * seq_len
    if len(known) == len(sources) and sum(known) < wanted:
        warnings.warn(
            f"the held-out split has {sum(known)} tokens but {num_batches} eval batches of "
            f"{batch_size}x{seq_len} need {wanted}; evaluation repeats rows (lower train.eval_batches or "
            "raise data.held_out_fraction)",
            stacklevel=2,
        )
    return [next_batch(rows, batch_size) for _ in range(num_batches)]


# ---------------------------------------------------------------------------------------------
# Prefetching


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """Calls ``produce()`` on a background thread, keeping up to ``depth`` results ready.

    ``next(prefetcher)`` returns results in order; an exception in ``produce`` is raised there.
    ``depth=0`` calls ``produce`` synchronously. The producer runs ahead of the consumer, so to
    checkpoint the data position, have it return the state with each batch, e.g.
    ``Prefetcher(lambda: (next_batch(rows, size_for(step)), rows.get_state()), depth)``, and save
    the state that came with the last batch consumed; only the producer thread may touch ``rows``.
    """

    def __init__(self, produce: Callable[[], T], depth: int):
        if depth < 0:
            raise ValueError(f"depth={depth} must be >= 0")
        self._produce = produce
        self._stop = threading.Event()
        self._queue: queue.Queue[T | _Failure] = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth:
            self._thread = threading.Thread(target=self._run, name="zaya-data-prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item: T | _Failure = self._produce()
            except BaseException as err:  # handed to the consumer, which decides
                item = _Failure(err)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._thread is None:
            return self._produce()
        if self._stop.is_set():
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the producer thread (idempotent); waits for the ``produce`` call in flight."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
