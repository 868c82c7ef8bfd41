"""The global batch as a fixed number of row streams, so that what a step trains on never depends
on how many processes read it: a run saved by P processes resumes on any other process count and
trains on exactly the rows an uninterrupted run would have seen.

Stream ``k`` of ``S`` (``data.streams``) is a :class:`~zaya_jax.data.pipeline.RowIterator` over
documents ``k, k + S, ...`` of every source. A global batch of ``B`` rows is the concatenation of
``B / S`` rows of each stream in order (rows ``[kB/S, (k+1)B/S)`` come from stream ``k``), and
process ``p`` of ``P`` keeps global rows ``[pB/P, (p+1)B/P)``. A process runs the streams whose
block overlaps its rows; where ``P`` does not divide ``S`` the stream on the border of two processes
is run by both, each keeping its own rows (at most one stream of duplicated reading per border).
Which streams a process runs does not depend on ``B`` (the blocks are the fractions ``k/S`` and
``p/P`` of any batch), so a batch ramp never moves a stream between processes.

A checkpoint holds, per process, the states of the streams it ran; restoring merges the files of
all saving processes, whatever their number, so each stream continues where it stopped.

Why not Grain's process sharding (``ShardByJaxProcess``, or ``dataset[p::P]`` as before): it makes
the token stream a function of the process count, so a job that lost a node cannot continue on the
others with the same data (torchtitan refuses the same resume, pytorch/torchtitan#816).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from zaya_jax.config import ConfigError, DataConfig
from zaya_jax.data.documents import tokenized_documents
from zaya_jax.data.pipeline import RowIterator, next_batch, stream_rows_of
from zaya_jax.data.sources import DataError
from zaya_jax.data.tokenizers import Tokenizer

# The default stream count: the largest power of two up to this that divides every batch size and
# that every training source has documents for (see auto_streams).
AUTO_STREAMS = 8


def auto_streams(batch_sizes: Iterable[int], documents: Iterable[int]) -> int:
    """``data.streams: 0``: the largest power of two <= AUTO_STREAMS dividing every batch size, and
    at most the fewest training documents of any source (each stream needs one of every source).
    Both are properties of the schedule and the data, never of the process count."""
    limit = min([AUTO_STREAMS, *documents])
    streams = 1
    while streams * 2 <= limit and all(size % (streams * 2) == 0 for size in batch_sizes):
        streams *= 2
    return streams


def streams_run_by(streams: int, process_index: int, process_count: int) -> range:
    """The streams process ``process_index`` of ``process_count`` runs (the same for every batch size)."""
    first = process_index * streams // process_count
    end = -(-(process_index + 1) * streams // process_count)  # ceil
    return range(first, end)


def stream_rows(
    batch_size: int, streams: int, process_index: int, process_count: int
) -> list[tuple[int, int, int]]:
    """``(stream, first, end)``: the rows ``[first, end)`` of each stream's ``batch_size / streams``
    that process ``process_index`` keeps, in global row order."""
    for count, what in ((streams, "data.streams"), (process_count, "processes")):
        if batch_size % count:
            raise ConfigError(
                f"a batch of {batch_size} rows cannot be split over {count} {what}; make every batch size "
                f"a multiple of {count}"
            )
    per_stream, per_process = batch_size // streams, batch_size // process_count
    low, high = process_index * per_process, (process_index + 1) * per_process
    out = []
    for k in streams_run_by(streams, process_index, process_count):
        first, end = max(low, k * per_stream), min(high, (k + 1) * per_stream)
        out.append((k, first - k * per_stream, end - k * per_stream))
    return out


class BatchStreams:
    """This process's rows of every global batch (see the module doc)."""

    def __init__(
        self,
        make_stream: Callable[[int], RowIterator],
        *,
        streams: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if streams < 1:
            raise ConfigError(f"data.streams={streams} must be >= 1")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
        self.count, self.process_index, self.process_count = streams, process_index, process_count
        self._streams = {k: make_stream(k) for k in streams_run_by(streams, process_index, process_count)}

    @property
    def running(self) -> list[int]:
        return list(self._streams)

    def next_batch(self, batch_size: int) -> dict[str, np.ndarray]:
        """This process's ``batch_size / process_count`` rows of the next global batch."""
        parts = []
        for k, first, end in stream_rows(batch_size, self.count, self.process_index, self.process_count):
            rows = next_batch(self._streams[k], batch_size // self.count)
            parts.append({key: value[first:end] for key, value in rows.items()})
        return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}

    def get_state(self) -> dict[str, Any]:
        """The streams this process runs and their positions (JSON-able)."""
        return {"count": self.count, "states": {str(k): it.get_state() for k, it in self._streams.items()}}

    def set_state(self, saved: Sequence[dict[str, Any]]) -> None:
        """Continue from the states of :meth:`get_state` saved by every process of a run, whatever
        their number; each stream this process runs must be in one of them."""
        merged: dict[str, Any] = {}
        for state in saved:
            if int(state["count"]) != self.count:
                raise DataError(
                    f"the saved data position has {state['count']} data streams but this run has "
                    f"data.streams={self.count}; set data.streams={state['count']} to continue it"
                )
            for k, stream_state in state["states"].items():
                if merged.setdefault(k, stream_state) != stream_state:
                    raise DataError(
                        f"the saved data positions disagree on stream {k}: the checkpoint is damaged"
                    )
        missing = [k for k in self._streams if str(k) not in merged]
        if missing:
            raise DataError(
                f"the saved data position has no state for data streams {missing} (it holds "
                f"{sorted(int(k) for k in merged)}): a process's file is missing from the checkpoint"
            )
        for k, it in self._streams.items():
            it.set_state(merged[str(k)])


def shuffle_window_per_stream(window: int, streams: int) -> int:
    """Each stream's share of ``data.shuffle_window`` rows (so memory does not grow with streams)."""
    return math.ceil(window / streams) if window > 1 else window


def make_batch_streams(
    data_cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    seed: int,
    batch_sizes: Sequence[int],
    mixture: Sequence[float] | None = None,
    process_index: int = 0,
    process_count: int = 1,
    references: Mapping[str, np.ndarray] | None = None,
) -> BatchStreams:
    """This process's share of the training batches of ``data_cfg``, tokenized once for all its
    streams; ``data.streams`` of them (0: :func:`auto_streams` over ``batch_sizes``, every batch
    size the run will use)."""
    sources = tokenized_documents(data_cfg, "train", tokenizer, references)
    count = data_cfg.streams or auto_streams(batch_sizes, [len(s.documents) for s in sources])
    window = shuffle_window_per_stream(data_cfg.shuffle_window, count)

    def make_stream(k: int) -> RowIterator:
        return stream_rows_of(
            sources,
            tokenizer,
            seq_len=seq_len,
            seed=seed,
            mixture=mixture,
            split="train",
            stream=k,
            streams=count,
            shuffle_window=window,
        )

    return BatchStreams(make_stream, streams=count, process_index=process_index, process_count=process_count)
