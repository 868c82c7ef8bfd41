"""Packing token documents into rows of exactly ``seq_len`` (input, target) pairs.

Row format (every array has length ``seq_len``; field dtypes in :mod:`zaya_jax.data.batch`):

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
  of text are always full; only the last row of a finite stream is padded.

Chat documents ((2, n) arrays: ids over a trained mask, :mod:`zaya_jax.data.chat`) are packed whole:
``loss_mask`` is 1 on the pairs whose target is a trained token (and on the final pair into EOS when
the conversation ends in a trained token), a conversation that does not fit in what is left of a
row starts the next one (the rest of the row is padding), and one longer than a row is cut into
row-sized pieces after an assistant turn (where a trained span ends) when one falls inside the row,
else at the row's end. Each piece is its own segment: a piece never attends to another.

Preference pairs ((3, n) arrays, :mod:`zaya_jax.data.preference`, or :class:`ScoredPair` s with
their reference log-probabilities) are placed whole in one row, the chosen sequence (+ EOS) as one
segment and the rejected one (+ EOS) as the next, so in a row of pairs segment ``2k + 1`` is the
k-th pair's chosen and ``2k + 2`` its rejected; ``loss_mask`` marks the completion's targets. A
pair that does not fit in what is left of a row starts the next one, and a pair longer than a whole
row is left out (:func:`pair_fits`). A scored pair also fills ``reference_logps`` with each
sequence's reference log-probability on its segment's first position.

Why not Grain's ``grain.experimental.ConcatThenSplitIterDataset``: it packs tokens of named
features, not (input, target) pairs, so a document split across rows either loses the pair at the
split or needs a second, shifted feature; it passes elements that are already full through ahead
of the buffer (the row order then depends on document lengths, not on the shuffled document order);
its positions continue across a split instead of restarting; and its checkpoint state carries the
buffered remainder rather than (document, offset). Checkpointed data positions of existing runs
name this packer's state, so replacing it would not resume them bit-identically. This packer is
~60 lines, and ``tests/data/test_pipeline.py`` pins its rows and its state round trip.
"""

from __future__ import annotations

import hashlib
from typing import Any

import grain
import numpy as np

from zaya_jax.data.batch import empty_row
from zaya_jax.data.documents import DocumentSequence, ScoredPair
from zaya_jax.data.preference import CHOSEN, REJECTED
from zaya_jax.data.sources import DataError

# Synchronous reads: documents are in memory or a local ArrayRecord read of ~10 us, and the
# Prefetcher thread already overlaps the whole pipeline with the training step.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)

# Sources of at most this many documents are shuffled by a permutation drawn per epoch
# (:class:`EpochShuffle`), larger ones by Grain's ``MapDataset.shuffle``.
SMALL_SOURCE = 1 << 20


class EpochShuffle(grain.MapDataset):
    """``parent`` (a finite dataset) in a new random order every epoch: index ``e * n + i`` is
    ``parent[perm_e[i]]``, ``perm_e`` a permutation drawn from ``(seed, e)``; the permutation of the
    epoch being read is kept. Why not Grain's ``shuffle`` here: its ``index_shuffle`` cycle-walks a
    cipher over a fixed-size domain, so one index of a small dataset costs about 25 ms / n (1.7 ms
    per document of a 15-record SFT file, 30 us at 1,000, 3.7 us from 10^6 up), and packing a window
    of rows from a small file took minutes. At most :data:`SMALL_SOURCE` documents: one epoch's
    permutation is 8 MB."""

    def __init__(self, parent: grain.MapDataset, seed: int):
        super().__init__(parent)
        self._seed, self._n = seed, len(parent)
        self._epoch, self._perm = -1, np.zeros(0, np.int64)

    def __len__(self) -> int:
        return self._n

    def __str__(self) -> str:
        return f"EpochShuffle(seed={self._seed})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, i = divmod(index, self._n)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self._seed, epoch]).permutation(self._n)
        return self._parents[0][int(self._perm[i])]


def rows_per_pass(documents: int, tokens: int | None, seq_len: int) -> int | None:
    """At most how many rows one pass over ``documents`` documents of ``tokens`` tokens in all packs
    into (None when ``tokens`` is unknown): every document adds its EOS, and a chat or preference
    document may leave the rest of a row empty."""
    return None if tokens is None else documents + (tokens + documents) // seq_len + 1


def pair_fits(document: np.ndarray, seq_len: int) -> bool:
    """Whether a (3, n) pair document fits in one row: n tokens (+ one EOS per sequence) give n pairs."""
    return document.shape[1] <= seq_len


class _PackDatasetIterator(grain.DatasetIterator):
    """Greedy concat-then-split packing of (document + EOS) pairs into rows (see module doc).

    Checkpoint state: the parent's state *before* the document being packed, plus how many of its
    pairs are already placed; restoring re-reads that one document, so the state stays small.
    """

    def __init__(
        self,
        parent: grain.DatasetIterator,
        seq_len: int,
        eos_id: int,
        pad_id: int,
        pass_length: int = 0,
        name: str = "",
    ):
        super().__init__(parent)
        self._seq_len = seq_len
        self._pass_length, self._name = pass_length, name
        self._dropped = 0  # pairs left out (too long) since the last piece placed
        self._eos = np.asarray([eos_id], np.int32)
        self._pad_id = pad_id
        self._doc: np.ndarray | None = None  # the current document + EOS, int32
        self._doc_state: dict[str, Any] = self._parent.get_state()
        self._offset = 0  # pairs of the current document already placed
        self._trained: np.ndarray | None = None  # chat: per token (EOS included), 1 = trained
        self._cuts = np.zeros(0, np.int64)  # chat: pairs where a piece may start (after a turn)
        self._pair: ScoredPair | None = None  # a preference pair, placed whole

    def _load(self, document: np.ndarray | ScoredPair) -> None:
        self._offset = 0
        self._trained = None
        self._pair = None
        if isinstance(document, ScoredPair) or (document.ndim == 2 and document.shape[0] == 3):  # a pair
            self._pair = document if isinstance(document, ScoredPair) else ScoredPair(document, None)
            self._doc = np.zeros(self._pair.document.shape[1] + 1, np.int32)  # its length in pairs + 1
            return
        if document.ndim == 2:  # chat: (ids, trained)
            tokens, trained = np.asarray(document[0], np.int32), np.asarray(document[1], np.float32)
            if len(tokens):
                self._trained = np.concatenate([trained, trained[-1:]])
                self._cuts = np.flatnonzero((trained[:-1] == 1) & (trained[1:] == 0)) + 1
            document = tokens
        self._doc = np.concatenate([np.asarray(document, np.int32), self._eos]) if len(document) else None

    def _take(self, filled: int) -> int:
        """How many pairs of the current document go into a row filled up to ``filled`` (0: none,
        end the row here)."""
        remaining, space = len(self._doc) - 1 - self._offset, self._seq_len - filled
        if self._trained is None or remaining <= space:
            return min(remaining, space)
        if filled:
            return 0  # a conversation starts a fresh row rather than continue in another
        cuts = self._cuts[(self._cuts > self._offset) & (self._cuts <= self._offset + space)]
        return int(cuts[-1]) - self._offset if len(cuts) else space

    def __next__(self) -> dict[str, np.ndarray]:
        row = empty_row(self._seq_len, self._pad_id)
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
            if self._pair is not None:
                if not pair_fits(self._pair.document, self._seq_len):
                    self._offset = len(self._doc) - 1  # longer than a row: left out
                    self._dropped += 1
                    if (
                        self._pass_length and self._dropped >= self._pass_length
                    ):  # a repeating stream would loop forever
                        raise DataError(
                            f"every preference pair of {self._name or 'the source'} (in this data stream) is longer than "
                            f"a row of {self._seq_len} tokens (chosen and rejected together, each with EOS); raise "
                            "train.seq_len or drop the source"
                        )
                    continue
                self._dropped = 0
                if len(self._doc) - 1 > self._seq_len - filled:
                    return row  # padded: the pair starts the next row
                filled, segment = self._place_pair(row, filled, segment)
                self._offset = len(self._doc) - 1
                continue
            doc, start = self._doc, self._offset
            take = self._take(filled)
            if take == 0:
                return row  # padded: the next conversation starts the next row
            end = filled + take
            segment += 1
            row["inputs"][filled:end] = doc[start : start + take]
            row["targets"][filled:end] = doc[start + 1 : start + take + 1]
            row["segment_ids"][filled:end] = segment
            row["positions"][filled:end] = np.arange(take, dtype=np.int32)
            if self._trained is None:
                row["loss_mask"][filled:end] = 1.0
            else:
                row["loss_mask"][filled:end] = self._trained[start + 1 : start + take + 1]
            self._offset += take
            filled = end
        return row

    def _place_pair(self, row: dict[str, np.ndarray], filled: int, segment: int) -> tuple[int, int]:
        """The current pair's chosen and rejected sequences as the row's next two segments."""
        document, reference = self._pair
        for side, which in enumerate((CHOSEN, REJECTED)):
            part = document[:, document[2] == which]
            tokens = np.concatenate([part[0], self._eos])
            scored = np.concatenate([part[1], part[1][-1:]]).astype(np.float32)
            end = filled + len(tokens) - 1
            segment += 1
            row["inputs"][filled:end] = tokens[:-1]
            row["targets"][filled:end] = tokens[1:]
            row["segment_ids"][filled:end] = segment
            row["positions"][filled:end] = np.arange(end - filled, dtype=np.int32)
            row["loss_mask"][filled:end] = scored[1:]
            if reference is not None:
                row.setdefault("reference_logps", np.zeros(self._seq_len, np.float32))[filled] = reference[
                    side
                ]
            filled = end
        return filled, segment

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

    def __init__(
        self,
        parent: grain.IterDataset,
        *,
        seq_len: int,
        eos_id: int,
        pad_id: int,
        pass_length: int = 0,
        name: str = "",
    ):
        """``pass_length``: documents in one pass of a repeating ``parent`` (0: unknown), so a
        pass in which every preference pair is too long for a row is an error, not a hang;
        ``name`` the source in that error."""
        super().__init__(parent)
        self._seq_len = seq_len
        self._eos_id = eos_id
        self._pad_id = pad_id
        self._pass_length, self._name = pass_length, name

    def __iter__(self) -> _PackDatasetIterator:
        return _PackDatasetIterator(
            self._parent.__iter__(), self._seq_len, self._eos_id, self._pad_id, self._pass_length, self._name
        )

    def __str__(self) -> str:
        return f"PackIterDataset(seq_len={self._seq_len})"


def source_seed(seed: int, name: str) -> int:
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
    stream: int = 0,
    streams: int = 1,
    shuffle_window: int = 0,
    name: str = "",
    num_tokens: int | None = None,
) -> grain.IterDataset:
    """One source's pipeline: this stream's documents (``stream::streams``), shuffled per epoch, packed into rows, the
    rows shuffled within windows of ``shuffle_window`` (0 or 1: in packing order), a window no
    longer than one pass of the source packs into when its ``num_tokens`` are known (a window
    of many passes would wait for all of them before its first row, and repeat documents within
    a batch). ``name``: the source, in errors."""
    ds = grain.MapDataset.source(documents)
    if streams > 1:
        ds = ds[stream::streams]
    pass_length = len(ds)
    if shuffle:
        ds = EpochShuffle(ds, seed) if pass_length <= SMALL_SOURCE else ds.shuffle(seed=seed)
    if repeat:
        ds = ds.repeat()
    rows = PackIterDataset(
        ds.to_iter_dataset(_READ_OPTIONS), seq_len=seq_len, eos_id=eos_id, pad_id=pad_id, pass_length=pass_length,
        name=repr(name) if name else "",
    )  # fmt: skip
    one_pass = rows_per_pass(pass_length, num_tokens, seq_len)
    window = shuffle_window if one_pass is None else min(shuffle_window, one_pass)
    if shuffle and window > 1:
        rows = grain.experimental.WindowShuffleIterDataset(rows, window_size=window, seed=seed)
    return rows
