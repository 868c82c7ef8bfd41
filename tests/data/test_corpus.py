"""The built-in stdlib corpus and the held-out split."""

from __future__ import annotations

import numpy as np

from zaya_jax.config import DataConfig
from zaya_jax.data import ByteTokenizer, tokenized_documents
from zaya_jax.data.corpus import held_out_indices, held_out_key, stdlib_files, stdlib_root


def test_stdlib_corpus_is_large_sorted_and_excludes_installed_packages():
    files = stdlib_files()
    keys = [k for k, _ in files]
    assert keys == sorted(keys)
    assert "os.py" in keys and "json/decoder.py" in keys
    assert not any("site-packages" in k.split("/") or k.startswith("_sysconfigdata") for k in keys)
    if (stdlib_root() / "test").is_dir():  # distributions that strip test/ have a smaller corpus
        assert sum(p.stat().st_size for _, p in files) >= 20_000_000


def test_held_out_split_is_a_pinned_hash_of_the_key():
    # Pinned: changing the hash would move files between train and held-out on every machine.
    keys = [f"pkg/module_{i}.py" for i in range(20)]
    held = [int(k.removeprefix("pkg/module_").removesuffix(".py")) for k in keys if held_out_key(k, 0.2)]
    assert held == [2, 3, 6, 7, 10, 11, 15]


def test_held_out_fraction_is_respected_and_monotone():
    keys = [f"file_{i}.py" for i in range(20_000)]
    small = np.asarray([held_out_key(k, 0.02) for k in keys])
    large = np.asarray([held_out_key(k, 0.05) for k in keys])
    assert abs(small.mean() - 0.02) < 0.005 and abs(large.mean() - 0.05) < 0.008
    assert np.all(large[small])
    mask = held_out_indices(100_000, 0.1)
    assert abs(mask.mean() - 0.1) < 0.005
    np.testing.assert_array_equal(mask, held_out_indices(100_000, 0.1))
    assert not np.array_equal(mask, held_out_indices(100_000, 0.1, salt=1))


def test_stdlib_train_and_held_out_never_share_a_file():
    cfg = DataConfig(held_out_fraction=0.05)
    tok = ByteTokenizer()
    (train,) = tokenized_documents(cfg, "train", tok)
    (held,) = tokenized_documents(cfg, "held_out", tok)
    (everything,) = tokenized_documents(cfg, "all", tok)
    train_starts = set(train.documents.starts.tolist())
    held_starts = set(held.documents.starts.tolist())
    assert len(held.documents) > 0 and not train_starts & held_starts
    assert train_starts | held_starts == set(everything.documents.starts.tolist())
    # The split is the key hash: the held-out documents are exactly the held-out files.
    held_texts = {tok.decode(held.documents[i]) for i in range(len(held.documents))}
    expected = {
        p.read_text(encoding="utf-8") for k, p in stdlib_files() if held_out_key(k, 0.05) and p.stat().st_size
    }
    assert held_texts <= expected and len(expected) - len(held_texts) <= 2  # minus undecodable files
    assert everything.skipped >= 1  # the stdlib's deliberately non-UTF-8 test files
