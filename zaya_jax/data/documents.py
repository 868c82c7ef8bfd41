"""Token documents per source: text sources tokenized once per process (cached), prepared
ArrayRecord shards read in place, the built-in corpus, each split into train / held-out.

:func:`tokenized_documents` returns one :class:`SourceDocuments` per configured source, each with a
fingerprint naming its exact contents (checkpointed iterator states refuse other contents).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from zaya_jax.config import DataConfig, DataSource
from zaya_jax.data import corpus
from zaya_jax.data.chat import read_chat_documents
from zaya_jax.data.preference import read_preference_documents
from zaya_jax.data.prepared.reader import PreparedDocuments, open_prepared
from zaya_jax.data.sources import DataError, file_signature, read_documents
from zaya_jax.data.tokenizers import Tokenizer, token_dtype

Split = Literal["train", "held_out", "all"]
_CACHE_ENTRIES = 8


class DocumentSequence(Protocol):
    """Random access to token documents: ``docs[i]`` -> (num_tokens,) integer array."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


class TokenizedDocuments:
    """Documents in memory: document ``i`` is ``tokens[starts[i]:ends[i]]``, or with a ``trained``
    mask (chat) the (2, n) array of those tokens over ``trained[starts[i]:ends[i]]``, and with a
    ``part`` too (preference pairs) the (3, n) array of tokens, scored mask and 1 chosen / 2 rejected;
    a selection of documents shares the same arrays."""

    def __init__(
        self,
        tokens: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        trained: np.ndarray | None = None,
        part: np.ndarray | None = None,
    ):
        self.tokens = tokens
        self.starts = starts
        self.ends = ends
        self.trained = trained
        self.part = part

    def select(self, indices: np.ndarray) -> TokenizedDocuments:
        return TokenizedDocuments(
            self.tokens, self.starts[indices], self.ends[indices], self.trained, self.part
        )

    @property
    def num_tokens(self) -> int:
        return int((self.ends - self.starts).sum())

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> np.ndarray:
        piece = slice(self.starts[index], self.ends[index])
        if self.trained is None:
            return self.tokens[piece]
        rows = [self.tokens[piece], self.trained[piece]]
        if self.part is not None:
            rows.append(self.part[piece])
        return np.stack([row.astype(np.int32) for row in rows])


class ScoredPair(NamedTuple):
    """A preference pair document ((3, n), :mod:`zaya_jax.data.preference`) with the reference
    model's log-probabilities of its chosen and rejected completions."""

    document: np.ndarray
    reference: np.ndarray  # (2,) float32: chosen, rejected


class ScoredDocuments:
    """Pair documents with their reference log-probabilities (``reference[i]`` of document ``i``)."""

    def __init__(self, base: DocumentSequence, reference: np.ndarray):
        if len(reference) != len(base):
            raise DataError(
                f"{len(reference)} reference log-probabilities for {len(base)} pairs: the run's reference/ "
                "does not belong to this data"
            )
        self.base, self.reference = base, reference

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> ScoredPair:
        return ScoredPair(self.base[index], self.reference[index])


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
            source.chat_template,
        ]
    )
    with _CACHE_LOCK:
        if cache_key in _CACHE:
            _CACHE.move_to_end(cache_key)
            return _CACHE[cache_key]
    if source.kind in ("chat", "preference"):
        read = read_chat_documents if source.kind == "chat" else read_preference_documents
        chats = read(source, tokenizer, on_bad_document)
        lengths = np.asarray([d.shape[1] for d in chats.documents], dtype=np.int64)
        ends = np.cumsum(lengths)
        flat = np.concatenate(chats.documents, axis=1)
        dtype = token_dtype(tokenizer.vocab_size)
        part = flat[2].astype(np.uint8) if source.kind == "preference" else None
        everything = TokenizedDocuments(
            flat[0].astype(dtype), ends - lengths, ends, flat[1].astype(np.uint8), part
        )
        keys, skipped = chats.keys, chats.skipped
    else:
        docs = read_documents(source, on_bad_document)  # type: ignore[arg-type]
        tokens, lengths = tokenizer.encode_concatenated(docs.texts)
        ends = np.cumsum(lengths)
        everything = TokenizedDocuments(tokens, ends - lengths, ends)
        keys, skipped = docs.keys, docs.skipped
    # A document the tokenizer maps to nothing carries no pair to learn from.
    kept = np.flatnonzero(lengths)
    entry = _Tokenized(everything.select(kept), [keys[i] for i in kept], skipped)
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


def tokenized_documents(
    data_cfg: DataConfig,
    split: Split,
    tokenizer: Tokenizer,
    references: Mapping[str, np.ndarray] | None = None,
) -> list[SourceDocuments]:
    """Every source of ``data_cfg`` as the token documents of ``split``, in config order.

    Text sources (stdlib, text, JSONL, Parquet, chat, preference) are read and tokenized once per
    process and cached; prepared ArrayRecord sources are opened (verified) and read lazily. The
    held-out split hashes each document's key (:mod:`zaya_jax.data.corpus`), so the splits never
    share a document. ``references``: per preference source, (pairs, 2) reference log-probabilities
    of all its pairs in ``split="all"`` order; its documents are then :class:`ScoredPair` s.
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
            indices = _split_indices(entry.mask(fraction), split)
            selected = entry.documents.select(indices)
            documents, num_tokens, skipped = selected, selected.num_tokens, entry.skipped
            if references is not None and source.name in references:
                reference = np.asarray(references[source.name], np.float32)
                if len(reference) != len(entry.documents):
                    raise DataError(
                        f"the reference log-probabilities cover {len(reference)} pairs but source "
                        f"{source.name!r} has {len(entry.documents)}: the data changed since they were "
                        "computed; train on the original data or start a new run"
                    )
                documents = ScoredDocuments(selected, reference[indices])
            parts: list[Any] = [
                source.kind,
                len(entry.documents),
                entry.documents.num_tokens,
                split,
                fraction,
            ]
            if entry.documents.trained is not None:  # chat: which tokens are trained is content too
                parts.append(int(entry.documents.trained.sum()))
            fingerprint = _digest(*parts)
        out.append(SourceDocuments(source.name, source.weight, documents, fingerprint, num_tokens, skipped))
    return out
