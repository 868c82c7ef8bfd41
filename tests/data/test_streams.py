"""Batches from data streams: the global batch of every step is the same on any number of processes,
and a position saved by one process count continues exactly on another."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tests.data.corpora import jsonl_config, varied_texts, write_jsonl
from zaya_jax.config import ConfigError
from zaya_jax.data import ByteTokenizer, DataError
from zaya_jax.data.streams import auto_streams, make_batch_streams, stream_rows, streams_run_by

TOK = ByteTokenizer()
SEQ = 16


@pytest.mark.parametrize("streams", [1, 2, 4, 8])
@pytest.mark.parametrize("processes", [1, 2, 3, 4, 6, 8])
def test_processes_keep_every_row_of_the_batch_once_for_every_batch_size(streams, processes):
    runs = [set(streams_run_by(streams, p, processes)) for p in range(processes)]
    assert set.union(*runs) == set(range(streams))
    for batch in (24, 48, 96):  # multiples of every stream and process count here
        rows = []
        for p in range(processes):
            shares = stream_rows(batch, streams, p, processes)
            assert {k for k, _, _ in shares} == runs[p]  # the same streams whatever the batch size
            rows += [k * batch // streams + i for k, first, end in shares for i in range(first, end)]
        assert rows == list(range(batch))  # in order, each global row kept by exactly one process
    with pytest.raises(ConfigError, match=r"batch of 20 rows cannot be split over 8 data\.streams"):
        stream_rows(20, 8, 0, 1)


def test_auto_streams_depends_on_batch_sizes_and_documents_only():
    assert auto_streams([16, 64], [1000]) == 8
    assert auto_streams([12, 24], [1000]) == 4
    assert auto_streams([6], [1000]) == 2
    assert auto_streams([16], [1000, 5]) == 4  # every stream needs a document of every source


@pytest.fixture
def two_sources(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", varied_texts(90, seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", varied_texts(60, seed=2, alphabet="klmnopqrst"))
    cfg = jsonl_config(("a", a, 2.0), ("b", b, 1.0))
    return dataclasses.replace(cfg, shuffle_window=8, streams=4)


def _open(cfg, processes: int, batch_sizes=(12, 24)):
    return [
        make_batch_streams(
            cfg, TOK, seq_len=SEQ, seed=5, batch_sizes=batch_sizes, process_index=p, process_count=processes
        )
        for p in range(processes)
    ]


def _global_batches(parts, sizes) -> list[np.ndarray]:
    """The global batches (inputs, targets and segments side by side) of the processes ``parts``."""
    out = []
    for size in sizes:
        local = [part.next_batch(size) for part in parts]
        assert all(len(x["inputs"]) == size // len(parts) for x in local)
        out.append(
            np.concatenate([np.stack([x["inputs"], x["targets"], x["segment_ids"]], 1) for x in local])
        )
    return out


SIZES = [12, 12, 24, 12, 24, 24, 12, 24]  # a batch ramp that also goes down (a curriculum may)


@pytest.mark.parametrize("saved_by, resumed_on", [(2, 1), (2, 3), (2, 4), (1, 6), (3, 2), (4, 12)])
def test_a_position_saved_by_some_processes_continues_exactly_on_others(two_sources, saved_by, resumed_on):
    reference = _global_batches(_open(two_sources, 1), SIZES)
    first = _open(two_sources, saved_by)
    assert_batches_equal(_global_batches(first, SIZES[:3]), reference[:3])
    saved = [json.loads(json.dumps(part.get_state())) for part in first]  # as written to the checkpoint
    resumed = _open(two_sources, resumed_on)
    for part in resumed:
        part.set_state(saved)
    assert_batches_equal(_global_batches(resumed, SIZES[3:]), reference[3:])


def assert_batches_equal(a, b) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        np.testing.assert_array_equal(x, y, err_msg=f"step {step}")


def test_the_streams_hold_different_rows_and_all_the_documents(two_sources):
    (one,) = _open(two_sources, 1)
    batch = one.next_batch(24)["inputs"]
    blocks = [batch[k * 6 : (k + 1) * 6] for k in range(4)]
    assert all(not np.array_equal(blocks[0], block) for block in blocks[1:])
    assert one.running == [0, 1, 2, 3]


def test_changed_streams_seed_or_lost_files_are_refused_naming_the_fix(two_sources):
    parts = _open(two_sources, 2)
    _global_batches(parts, [12])
    saved = [part.get_state() for part in parts]
    (other,) = _open(dataclasses.replace(two_sources, streams=2), 1)
    with pytest.raises(
        DataError, match=r"has 4 data streams but this run has data\.streams=2; set data\.streams=4"
    ):
        other.set_state(saved)
    (one,) = _open(two_sources, 1)
    with pytest.raises(DataError, match=r"no state for data streams \[2, 3\].*a process's file is missing"):
        one.set_state(saved[:1])
    reseeded = make_batch_streams(two_sources, TOK, seq_len=SEQ, seed=6, batch_sizes=[12])
    with pytest.raises(DataError, match=r"seed=.*changed since the checkpoint"):
        reseeded.set_state(saved)
    with pytest.raises(ConfigError, match="cannot be split over 5 processes"):
        _open(two_sources, 5, batch_sizes=[12])[0].next_batch(12)
