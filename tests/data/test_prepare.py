"""`prepare`: ArrayRecord shards + manifest, verified on read; no half-written directory looks complete."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from tests.data.corpora import train_bpe_tokenizer, write_jsonl, write_parquet
from zaya_jax.config import DataConfig, DataSource
from zaya_jax.data import ByteTokenizer, DataError, HFTokenizer, make_row_iterator, open_prepared, prepare
from zaya_jax.data.prepared.format import MANIFEST, shard_name
from zaya_jax.staging import StagedDirectory, lock_path, staging_path

TEXTS = ["first text file", "second, longer text file ü", "jsonl one", "jsonl two", "pq a", "pq b", "pq c"]


def make_inputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "docs").mkdir()
    (src / "docs" / "1.txt").write_text(TEXTS[0])
    (src / "docs" / "2.txt").write_text(TEXTS[1])
    jsonl = write_jsonl(src / "more.jsonl", TEXTS[2:4])
    parquet = write_parquet(src / "table.parquet", TEXTS[4:])
    return [src / "docs", jsonl, parquet]


def test_prepare_writes_shards_and_a_manifest_that_describes_them(tmp_path):
    out = tmp_path / "prepared"
    manifest = prepare(make_inputs(tmp_path), out, num_shards=3)
    assert json.loads((out / MANIFEST).read_text()) == manifest
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, *(shard_name(i, 3) for i in range(3))])
    assert manifest["tokenizer"] == ByteTokenizer().spec and manifest["dtype"] == "uint16"
    assert manifest["documents"] == len(TEXTS)
    assert manifest["tokens"] == sum(len(t.encode()) for t in TEXTS)
    assert manifest["skipped_documents"] == 0
    assert [s["records"] for s in manifest["shards"]] == [3, 2, 2]
    assert sum(s["tokens"] for s in manifest["shards"]) == manifest["tokens"]
    for shard in manifest["shards"]:
        data = (out / shard["file"]).read_bytes()
        assert shard["bytes"] == len(data) and shard["sha256"] == hashlib.sha256(data).hexdigest()
    assert [i["documents"] for i in manifest["inputs"]] == [2, 2, 3]
    docs = open_prepared(out, ByteTokenizer())
    tok = ByteTokenizer()
    assert [tok.decode(docs[i]) for i in range(len(docs))] == TEXTS  # input order survives sharding


def test_prepared_rows_reproduce_the_documents_in_order(tmp_path):
    out = tmp_path / "prepared"
    prepare(make_inputs(tmp_path), out, num_shards=2)
    cfg = DataConfig(sources=(DataSource(name="p", kind="arrayrecord", path=str(out)),))
    rows = make_row_iterator(
        cfg, ByteTokenizer(), seq_len=8, seed=0, split="all", shuffle=False, repeat=False
    )
    inputs = np.concatenate([r["inputs"][r["loss_mask"] > 0] for r in rows])
    tok = ByteTokenizer()
    expected = np.concatenate([tok.encode(t) for t in TEXTS])  # every token is an input once
    np.testing.assert_array_equal(inputs, expected)


def test_prepare_refuses_a_non_empty_output_directory(tmp_path):
    out = tmp_path / "prepared"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(DataError, match="not empty; prepare never overwrites"):
        prepare(make_inputs(tmp_path), out)
    assert (out / "keep.txt").read_text() == "precious"


def test_failed_prepare_leaves_nothing_behind(tmp_path):
    inputs = make_inputs(tmp_path)
    (tmp_path / "src" / "docs" / "3.txt").write_bytes(b"\xff\xfe bad")
    out = tmp_path / "prepared"
    with pytest.raises(DataError, match=r"3\.txt is not valid UTF-8"):
        prepare(inputs, out)
    assert not out.exists()
    manifest = prepare(inputs, out, on_bad_document="skip")
    assert manifest["skipped_documents"] == 1 and manifest["documents"] == len(TEXTS)


def test_corrupt_shard_byte_is_detected_and_names_the_shard(tmp_path):
    out = tmp_path / "prepared"
    manifest = prepare(make_inputs(tmp_path), out, num_shards=2)
    victim = out / manifest["shards"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"shard .*{victim.name} is corrupt"):
        open_prepared(out, ByteTokenizer())


def test_missing_or_resized_shard_is_named(tmp_path):
    out = tmp_path / "prepared"
    manifest = prepare(make_inputs(tmp_path), out, num_shards=2)
    first, second = (out / s["file"] for s in manifest["shards"])
    with second.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match=rf"shard .*{second.name} has .* bytes but the manifest says"):
        open_prepared(out)
    first.unlink()
    with pytest.raises(DataError, match=rf"shard .*{first.name} .* is missing"):
        open_prepared(out)


def test_unfinished_preparation_is_never_read(tmp_path):
    out = tmp_path / "prepared"
    prepare(make_inputs(tmp_path), out)
    (out / MANIFEST).unlink()
    cfg = DataConfig(sources=(DataSource(name="p", kind="arrayrecord", path=str(out)),))
    with pytest.raises(DataError, match=r"manifest\.json is missing"):
        make_row_iterator(cfg, ByteTokenizer(), seq_len=8, seed=0)


def test_reading_with_another_tokenizer_is_refused(tmp_path):
    out = tmp_path / "prepared"
    prepare(make_inputs(tmp_path), out)
    hf = HFTokenizer(train_bpe_tokenizer(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match=r"tokenized with .*'byte'.*set data\.tokenizer"):
        open_prepared(out, hf)


def test_hf_tokenized_shards_hold_the_tokenizer_ids(tmp_path):
    path = train_bpe_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "prepared"
    manifest = prepare(make_inputs(tmp_path), out, tokenizer_spec=str(path), num_shards=2)
    hf = HFTokenizer(path)
    assert manifest["tokenizer"]["sha256"] == hf.spec["sha256"]
    docs = open_prepared(out, hf)
    for i, text in enumerate(TEXTS):
        np.testing.assert_array_equal(docs[i], hf.encode(text))


def _files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_killed_preparation_leaves_no_output_and_the_rerun_finishes_identically(tmp_path):
    inputs = make_inputs(tmp_path)
    reference = prepare(inputs, tmp_path / "reference" / "prepared", num_shards=2)
    # what a preparation killed while writing leaves: its staging directory and a free lock beside it
    out = tmp_path / "data" / "prepared"
    out.parent.mkdir()
    staging, lock = staging_path(out), lock_path(out)
    staging.mkdir()
    (staging / shard_name(0, 2)).write_bytes(b"half a shard")
    lock.write_text("12345 zaya data prepare\n")
    with pytest.raises(DataError, match=r"manifest\.json is missing"):
        open_prepared(staging)  # never read
    assert prepare(inputs, out, num_shards=2) == reference
    assert sorted(p.name for p in out.parent.iterdir()) == ["prepared"]  # staging and lock gone
    assert _files(out) == _files(tmp_path / "reference" / "prepared")  # byte for byte
    assert "seconds" not in reference  # nothing in the manifest varies between two preparations


def test_a_rerun_over_a_finished_preparation_succeeds_only_when_identical(tmp_path):
    inputs = make_inputs(tmp_path)
    out = tmp_path / "prepared"
    manifest = prepare(inputs, out, num_shards=2)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare(inputs, out, num_shards=2) == manifest  # the job was requeued after it finished
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # left as it was
    with pytest.raises(DataError, match="not empty; zaya data prepare never overwrites"):
        prepare(inputs, out, num_shards=3)  # another preparation: refused
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_staging_directory_in_use_or_not_provably_ours_is_refused_and_kept(tmp_path):
    inputs = make_inputs(tmp_path)
    out = tmp_path / "prepared"
    staging = staging_path(out)
    staging.mkdir()
    (staging / "notes.txt").write_text("someone else's")  # no lock file beside it
    with pytest.raises(DataError, match=r"has no \.prepared\.partial\.lock beside it"):
        prepare(inputs, out)
    assert (staging / "notes.txt").read_text() == "someone else's"
    (staging / "notes.txt").unlink()
    busy = pytest.raises(DataError, match="being written by another process right now")
    with StagedDirectory(out, "zaya data prepare"), busy:  # another preparation holds the lock
        prepare(inputs, out)
    assert not out.exists() and not staging.exists()
