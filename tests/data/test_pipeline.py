"""Packed rows, mixtures, shuffling, checkpointed iterator state, stream sharding and batching."""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest

from tests.data.corpora import (
    assert_valid_row,
    jsonl_config,
    pair_stream,
    train_bpe_tokenizer,
    varied_texts,
    write_jsonl,
)
from zaya_jax.config import ConfigError, DataConfig, DataSource
from zaya_jax.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    eval_batches,
    make_row_iterator,
    next_batch,
    tokenized_documents,
)
from zaya_jax.data.packing import packed_rows, rows_per_pass
from zaya_jax.data.prefetch import Prefetcher

TOK = ByteTokenizer()
SEQ = 16


def take(rows, n: int) -> list[dict[str, np.ndarray]]:
    return [next(rows) for _ in range(n)]


def assert_rows_equal(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.fixture
def one_source(tmp_path) -> tuple[DataConfig, list[str]]:
    texts = varied_texts(60)
    return jsonl_config(("a", write_jsonl(tmp_path / "a.jsonl", texts), 1.0)), texts


def test_rows_are_full_valid_and_reproduce_the_documents_with_eos(one_source):
    cfg, texts = one_source
    rows = list(make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, split="all", shuffle=False, repeat=False))
    for row in rows[:-1]:
        assert_valid_row(row, SEQ, TOK.pad_id)
        assert row["loss_mask"].sum() == SEQ  # only the last row of a finite stream has padding
    assert_valid_row(rows[-1], SEQ, TOK.pad_id)
    assert rows[-1]["loss_mask"].sum() < SEQ
    inputs, targets = pair_stream(rows)
    docs = [np.r_[TOK.encode(t), TOK.eos_id] for t in texts]
    np.testing.assert_array_equal(inputs, np.concatenate([d[:-1] for d in docs]))
    np.testing.assert_array_equal(targets, np.concatenate([d[1:] for d in docs]))


def test_segments_never_let_a_target_cross_into_another_document(one_source):
    cfg, _ = one_source
    rows = take(make_row_iterator(cfg, TOK, seq_len=SEQ, seed=3), 200)
    for row in rows:
        assert_valid_row(row, SEQ, TOK.pad_id)
        seg = row["segment_ids"]
        last = np.r_[seg[:-1] != seg[1:], True]  # the last position of every segment
        # A segment ends with the document's EOS target, or at the row's end (it continues).
        ends_inside = last[:-1]
        assert np.all(row["targets"][:-1][ends_inside] == TOK.eos_id)
        assert not np.any(row["inputs"] == TOK.eos_id)
    # Some documents were split across rows and some rows hold several documents.
    assert any(r["segment_ids"].max() > 2 for r in rows)
    assert any(r["targets"][-1] != TOK.eos_id for r in rows)


def test_same_seed_same_rows_different_seed_different_rows(one_source):
    cfg, _ = one_source
    a = take(make_row_iterator(cfg, TOK, seq_len=SEQ, seed=1), 50)
    b = take(make_row_iterator(cfg, TOK, seq_len=SEQ, seed=1), 50)
    c = take(make_row_iterator(cfg, TOK, seq_len=SEQ, seed=2), 50)
    assert_rows_equal(a, b)
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c, strict=True))


def test_every_epoch_is_a_new_permutation_of_all_documents(tmp_path):
    # One document per row: each document is SEQ characters, i.e. exactly SEQ pairs.
    texts = [chr(ord("A") + i) * SEQ for i in range(20)]
    cfg = jsonl_config(("a", write_jsonl(tmp_path / "a.jsonl", texts), 1.0))
    rows = take(make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, split="all"), 60)
    order = [TOK.decode(r["inputs"][:1]) for r in rows]
    epochs = [order[i : i + 20] for i in (0, 20, 40)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(t[0] for t in texts)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != sorted(epochs[0])


def test_mixture_weights_set_the_token_share(tmp_path):
    # Source a has short documents, b long ones: the share is of tokens, not documents.
    a = write_jsonl(tmp_path / "a.jsonl", varied_texts(200, seed=1, alphabet="abc")[:200])
    b = write_jsonl(tmp_path / "b.jsonl", ["x" * 300 + str(i) for i in range(20)])
    cfg = jsonl_config(("a", a, 3.0), ("b", b, 1.0))

    def share_of_a(rows) -> float:
        tokens = np.concatenate([r["inputs"][r["loss_mask"] > 0] for r in rows])
        from_a = np.isin(tokens, TOK.encode("abc"))
        return float(from_a.mean())

    assert share_of_a(take(make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0), 400)) == pytest.approx(
        0.75, abs=0.1
    )
    flipped = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, mixture=(1.0, 3.0))
    assert share_of_a(take(flipped, 400)) == pytest.approx(0.25, abs=0.1)
    only_b = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, mixture=(0.0, 1.0))
    assert share_of_a(take(only_b, 50)) == 0.0
    with pytest.raises(ConfigError, match="2 data sources"):
        make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, mixture=(1.0,))


def test_restored_iterator_continues_exactly(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", varied_texts(30, seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", varied_texts(10, seed=2, alphabet="xyz"))
    # a window of 32 rows (the default 4096 packs 4096 rows before the first one comes out)
    cfg = dataclasses.replace(jsonl_config(("a", a, 2.0), ("b", b, 1.0)), shuffle_window=32)
    original = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=5)
    take(original, 37)  # past the first epoch of source b, mid-document
    state = json.loads(json.dumps(original.get_state()))  # checkpoints store it as JSON
    expected = take(original, 50)
    restored = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=5)
    restored.set_state(state)
    assert_rows_equal(take(restored, 50), expected)


def test_restoring_into_another_seq_len_continues_the_same_token_stream(one_source):
    # The packing order (a row window shuffle reorders rows of one length; see the next test).
    cfg = dataclasses.replace(one_source[0], shuffle_window=0)
    short = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0)
    take(short, 7)
    state = short.get_state()
    expected = pair_stream(take(short, 6))
    longer = make_row_iterator(cfg, TOK, seq_len=3 * SEQ, seed=0)
    longer.set_state(state)
    got = pair_stream(take(longer, 2))
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_state_from_other_data_or_seed_is_refused(one_source, tmp_path):
    cfg, _ = one_source
    state = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0).get_state()
    with pytest.raises(DataError, match="seed=0 but this iterator has seed=1"):
        make_row_iterator(cfg, TOK, seq_len=SEQ, seed=1).set_state(state)
    other = jsonl_config(("a", write_jsonl(tmp_path / "other.jsonl", varied_texts(61)), 1.0))
    with pytest.raises(DataError, match=r"the data, seed or data\.streams changed"):
        make_row_iterator(other, TOK, seq_len=SEQ, seed=0).set_state(state)


def test_streams_read_disjoint_shares_that_cover_the_data(tmp_path):
    texts = [f"document number {i:03d}" for i in range(25)]
    cfg = jsonl_config(("a", write_jsonl(tmp_path / "a.jsonl", texts), 1.0))
    cfg = dataclasses.replace(cfg, shuffle_window=32)  # 32 rows to fill, not the default 4096
    seen = []
    for p in range(3):
        rows = make_row_iterator(
            cfg, TOK, seq_len=SEQ, seed=0, split="all", repeat=False, stream=p, streams=3
        )
        text = TOK.decode(np.concatenate([np.r_[r["inputs"][r["loss_mask"] > 0]] for r in rows]))
        seen.append({t for t in texts if t in text})
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert set.union(*seen) == set(texts)
    # The shuffled training rows of two streams differ too.
    a, b = (take(make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, stream=p, streams=2), 5) for p in range(2))
    assert not np.array_equal(pair_stream(a)[0], pair_stream(b)[0])


def test_too_few_documents_for_the_streams_is_a_clear_error(tmp_path):
    cfg = jsonl_config(("a", write_jsonl(tmp_path / "a.jsonl", ["one", "two"]), 1.0))
    with pytest.raises(DataError, match=r"fewer than the 4 data streams.*set data\.streams <= 2"):
        make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, split="all", stream=0, streams=4)


def test_next_batch_stacks_rows_and_batch_size_may_change(one_source):
    cfg, _ = one_source
    rows = take(make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0), 6)
    it = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0)
    first, second = next_batch(it, 4), next_batch(it, 2)
    assert first["inputs"].shape == (4, SEQ) and second["loss_mask"].shape == (2, SEQ)
    assert first["inputs"].dtype == np.int32 and first["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(
        np.concatenate([first["inputs"], second["inputs"]]), [r["inputs"] for r in rows]
    )


def test_eval_batches_are_fixed_and_held_out(tmp_path):
    texts = [f"doc {i} " + "z" * (i % 7) for i in range(200)]
    path = write_jsonl(tmp_path / "a.jsonl", texts)
    cfg = jsonl_config(("a", path, 1.0), held_out_fraction=0.2)
    a = eval_batches(cfg, TOK, seq_len=SEQ, batch_size=3, num_batches=2)
    b = eval_batches(cfg, TOK, seq_len=SEQ, batch_size=3, num_batches=2)
    assert len(a) == 2 and a[0]["inputs"].shape == (3, SEQ)
    assert_rows_equal(a, b)
    (held,) = tokenized_documents(cfg, "held_out", TOK)
    held_texts = [TOK.decode(held.documents[i]) for i in range(len(held.documents))]
    assert 0 < len(held_texts) < 100
    whole = 0
    for batch in a:
        for inputs, targets, segments in zip(
            batch["inputs"], batch["targets"], batch["segment_ids"], strict=True
        ):
            for segment in range(1, segments.max() + 1):
                piece = TOK.decode(inputs[segments == segment])
                assert any(piece in text for text in held_texts), piece
                # Segments after the first start a document; ending in EOS, they are whole ones.
                if segment > 1 and targets[segments == segment][-1] == TOK.eos_id:
                    assert piece in held_texts
                    whole += 1
    assert whole > 0


def test_held_out_split_leaves_out_sources_without_held_out_documents(tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", [f"text {i}" for i in range(100)])
    single = tmp_path / "single.txt"
    single.write_text("one lonely document")
    cfg = DataConfig(
        sources=(
            DataSource(name="big", kind="jsonl", path=str(big)),
            DataSource(name="single", kind="text", path=str(single)),
        ),
        held_out_fraction=0.2,
    )
    sizes = [len(s.documents) for s in tokenized_documents(cfg, "held_out", TOK)]
    assert sizes[0] > 0 and sizes[1] == 0  # the one document's key hashes into train
    assert make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, split="held_out").names == ["big"]


def test_default_config_trains_on_the_stdlib():
    rows = make_row_iterator(DataConfig(), TOK, seq_len=128, seed=0)
    batch = next_batch(rows, 4)
    assert batch["inputs"].shape == (4, 128) and batch["loss_mask"].sum() == 4 * 128
    for row in batch["inputs"]:
        TOK.decode(row)  # decodes; Python source is mostly ASCII
    assert np.isin(batch["inputs"], TOK.encode("def ")).mean() > 0.05


def test_hf_tokenizer_feeds_the_pipeline(tmp_path):
    hf = HFTokenizer(train_bpe_tokenizer(tmp_path / "tokenizer.json"))
    texts = ["hello world", "the quick brown fox", "héllo wörld"] * 3
    cfg = jsonl_config(("a", write_jsonl(tmp_path / "a.jsonl", texts), 1.0))
    rows = list(make_row_iterator(cfg, hf, seq_len=8, seed=0, split="all", shuffle=False, repeat=False))
    for row in rows:
        assert_valid_row(row, 8, hf.pad_id)
    inputs, targets = pair_stream(rows)
    np.testing.assert_array_equal(inputs, np.concatenate([hf.encode(t) for t in texts]))
    assert (targets == hf.eos_id).sum() == len(texts)


def test_prefetcher_keeps_order_and_raises_the_producers_error():
    counter = iter(range(5))

    def produce() -> int:
        value = next(counter, None)
        if value is None:
            raise RuntimeError("source broke")
        return value

    with Prefetcher(produce, depth=2) as prefetcher:
        assert [next(prefetcher) for _ in range(5)] == [0, 1, 2, 3, 4]
        with pytest.raises(RuntimeError, match="source broke"):
            next(prefetcher)
    assert [next(Prefetcher(iter(range(3)).__next__, depth=0)) for _ in range(1)] == [0]


def test_prefetcher_runs_ahead_on_a_thread_and_stops_on_close():
    started = threading.Event()
    calls = []

    def produce() -> int:
        calls.append(threading.current_thread().name)
        started.set()
        return len(calls)

    prefetcher = Prefetcher(produce, depth=3)
    assert started.wait(5)
    assert next(prefetcher) == 1
    prefetcher.close()
    assert all(name == "zaya-data-prefetch" for name in calls)
    assert len(calls) <= 1 + 3 + 1  # bounded by depth
    with pytest.raises(StopIteration):
        next(prefetcher)


def _keys(rows):
    return [row["inputs"].tobytes() + row["segment_ids"].tobytes() for row in rows]


def test_training_rows_are_shuffled_within_windows_of_the_packing_order(one_source):
    """``data.shuffle_window`` W: each run of W rows is the next W packed rows in another order, so
    a batch mixes documents (without it consecutive rows are consecutive pieces of one document)."""
    window = 16
    packed = make_row_iterator(dataclasses.replace(one_source[0], shuffle_window=0), TOK, seq_len=SEQ, seed=3)
    mixed = make_row_iterator(
        dataclasses.replace(one_source[0], shuffle_window=window), TOK, seq_len=SEQ, seed=3
    )
    in_order, shuffled = _keys(take(packed, 3 * window)), _keys(take(mixed, 3 * window))
    for w in range(3):
        part = slice(w * window, (w + 1) * window)
        assert sorted(shuffled[part]) == sorted(in_order[part])
        assert shuffled[part] != in_order[part]


def test_a_shuffled_stream_resumes_mid_window_exactly(one_source):
    cfg = dataclasses.replace(one_source[0], shuffle_window=16)
    rows = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=5)
    take(rows, 21)  # inside the second window
    state = json.loads(json.dumps(rows.get_state()))  # as saved in a checkpoint
    expected = _keys(take(rows, 20))
    restored = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=5)
    restored.set_state(state)
    assert _keys(take(restored, 20)) == expected


def test_the_row_shuffle_is_for_training_rows_only(one_source):
    cfg = dataclasses.replace(one_source[0], shuffle_window=16)
    evaluation = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, split="all", repeat=False)
    unshuffled = make_row_iterator(
        dataclasses.replace(cfg, shuffle_window=0), TOK, seq_len=SEQ, seed=0, split="all", repeat=False
    )
    training = make_row_iterator(cfg, TOK, seq_len=SEQ, seed=0, split="train")
    assert _keys(evaluation) == _keys(unshuffled)  # documents shuffled, rows in packing order
    assert _keys(take(training, 16)) != _keys(
        take(
            make_row_iterator(
                dataclasses.replace(cfg, shuffle_window=0), TOK, seq_len=SEQ, seed=0, split="train"
            ),
            16,
        )
    )


def test_packer_rows_and_state_are_pinned():
    """The exact rows and resume state of the built-in packer (checkpointed data positions of
    existing runs depend on both): three documents, EOS 1, padding 0, rows of 4 pairs."""
    import grain

    from zaya_jax.data.packing import PackIterDataset

    documents = [np.asarray(d) for d in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
    source = grain.MapDataset.source(documents).to_iter_dataset()
    rows = iter(PackIterDataset(source, seq_len=4, eos_id=1, pad_id=0))
    expected = [
        {
            "inputs": [5, 6, 7, 8],
            "targets": [6, 7, 1, 9],
            "segment_ids": [1, 1, 1, 2],
            "positions": [0, 1, 2, 0],
        },
        {
            "inputs": [9, 10, 11, 12],
            "targets": [1, 11, 12, 13],
            "segment_ids": [1, 2, 2, 2],
            "positions": [0, 0, 1, 2],
        },
        {
            "inputs": [13, 0, 0, 0],
            "targets": [1, 0, 0, 0],
            "segment_ids": [1, 0, 0, 0],
            "positions": [0, 0, 0, 0],
        },
    ]
    first = next(rows)
    state = rows.get_state()
    assert state == {"parent": {"next_index": 1}, "offset": 1, "has_document": True}  # inside document 2
    got = [first, next(rows), next(rows)]
    for row, want in zip(got, expected, strict=True):
        for key, values in want.items():
            assert row[key].tolist() == values, key
        assert row["loss_mask"].tolist() == [float(s > 0) for s in want["segment_ids"]]
    with pytest.raises(StopIteration):
        next(rows)
    resumed = iter(
        PackIterDataset(grain.MapDataset.source(documents).to_iter_dataset(), seq_len=4, eos_id=1, pad_id=0)
    )
    resumed.set_state(state)
    for row in got[1:]:
        again = next(resumed)
        assert all(np.array_equal(again[k], row[k]) for k in row)


class _Counted:
    """Documents that count how many were read."""

    def __init__(self, docs):
        self.docs, self.reads = docs, 0

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, index):
        self.reads += 1
        return self.docs[index]


def test_a_row_window_larger_than_the_source_holds_one_pass_not_thousands():
    """``data.shuffle_window`` of the tiny preset (65,536 rows) over a 20-document file: the
    window is cut to what one pass packs into, so the first row comes after one pass of reads (it
    took minutes to read the 131k documents of 6,554 passes), and each pass is still a new order."""
    docs = _Counted([np.full(SEQ, i, np.int32) for i in range(20)])  # one row each, with EOS
    tokens = 20 * SEQ
    bound = rows_per_pass(20, tokens, SEQ)
    rows = iter(
        packed_rows(docs, seq_len=SEQ, eos_id=0, pad_id=0, seed=1, shuffle_window=65536, num_tokens=tokens)
    )
    first = [int(next(rows)["inputs"][0]) for _ in range(20)]
    assert 20 <= bound < 50 and docs.reads <= bound + 2
    assert sorted(set(first)) != first[:1] and len(set(first)) > 10  # shuffled, mostly distinct
    # Without a known token count the configured window is kept.
    counted = _Counted(docs.docs)
    next(iter(packed_rows(counted, seq_len=SEQ, eos_id=0, pad_id=0, seed=1, shuffle_window=64)))
    assert counted.reads >= 64 and rows_per_pass(20, None, SEQ) is None
