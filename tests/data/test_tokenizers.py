"""Byte and Hugging Face tokenizers: round trips, special ids, specs, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from tests.data.corpora import train_bpe_tokenizer
from zaya_jax.data import ByteTokenizer, DataError, HFTokenizer, load_tokenizer
from zaya_jax.data.tokenizers import same_tokenizer

TEXT = "héllo wörld — 日本語 🎉\n\tend"


def test_byte_tokenizer_round_trips_non_ascii_text():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, np.frombuffer(TEXT.encode(), np.uint8).astype(np.int32) + 3)
    assert tok.decode(ids) == TEXT
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size) == (0, 1, 2, 259)
    assert ids.min() >= 3 and ids.max() < 259


def test_byte_decode_drops_special_and_out_of_range_ids_and_replaces_broken_utf8():
    tok = ByteTokenizer()
    ids = [2, *tok.encode("ab").tolist(), 1, 0, 300, *tok.encode("c").tolist()]
    assert tok.decode(ids) == "abc"
    assert tok.decode(np.asarray([[3 + 0xC3]])) == "\ufffd"  # half of "é"


def test_byte_batch_encodings_match_single_encodings():
    tok = ByteTokenizer()
    texts = ["abc", "", TEXT]
    for got, text in zip(tok.encode_batch(texts), texts, strict=True):
        np.testing.assert_array_equal(got, tok.encode(text))
    flat, lengths = tok.encode_concatenated(texts)
    assert flat.dtype == np.uint16
    assert lengths.tolist() == [len(t.encode()) for t in texts]
    np.testing.assert_array_equal(flat, np.concatenate([tok.encode(t) for t in texts]))


def test_hf_tokenizer_round_trips_and_finds_special_tokens(tmp_path):
    path = train_bpe_tokenizer(tmp_path / "tokenizer.json")
    tok = HFTokenizer(path)
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and len(ids) > 0
    assert tok.decode(ids) == TEXT
    assert tok.spec["kind"] == "hf" and tok.spec["path"] == str(path.resolve())
    assert len(tok.spec["sha256"]) == 64
    flat, lengths = tok.encode_concatenated(["hello world", "the fox"])
    np.testing.assert_array_equal(flat, np.concatenate([tok.encode("hello world"), tok.encode("the fox")]))
    assert lengths.tolist() == [len(tok.encode("hello world")), len(tok.encode("the fox"))]


def test_hf_tokenizer_special_tokens_can_be_named(tmp_path):
    path = train_bpe_tokenizer(tmp_path / "tokenizer.json")
    assert HFTokenizer(path, eos_token="<s>").eos_id == 2
    assert HFTokenizer(path, eos_token=0).eos_id == 0
    with pytest.raises(DataError, match="not a token"):
        HFTokenizer(path, eos_token="<nope>")


def test_load_tokenizer_picks_by_spec_and_names_a_missing_file(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    path = train_bpe_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(load_tokenizer(str(path)), HFTokenizer)
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)  # a model directory holding tokenizer.json
    missing = tmp_path / "absent" / "tokenizer.json"
    with pytest.raises(DataError, match=str(missing)):
        load_tokenizer(str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a valid Hugging Face tokenizer"):
        load_tokenizer(str(bad))


def test_tokenizer_identity_follows_contents_not_location(tmp_path):
    a = HFTokenizer(train_bpe_tokenizer(tmp_path / "a.json"))
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    b = HFTokenizer(train_bpe_tokenizer(moved / "tokenizer.json"))
    assert same_tokenizer(a.spec, b.spec)
    assert not same_tokenizer(a.spec, ByteTokenizer().spec)
    assert not same_tokenizer(a.spec, HFTokenizer(moved / "tokenizer.json", eos_token="<s>").spec)
