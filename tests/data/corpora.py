"""Tiny corpora written into a test's tmp_path, and the checks every packed row must pass."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from zaya_jax.config import DataConfig, DataSource
from zaya_jax.data import BATCH_KEYS


def write_jsonl(path: Path, texts: Sequence[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def write_parquet(path: Path, texts: Sequence[str | None], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: pa.array(texts, pa.string()), "id": list(range(len(texts)))}), path)
    return path


def varied_texts(n: int, seed: int = 0, alphabet: str = "abcdefghij") -> list[str]:
    """Documents of 1 to 40 characters (many shorter and many longer than a row)."""
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(alphabet), size=rng.integers(1, 41))) for _ in range(n)]


def jsonl_config(*sources: tuple[str, Path, float], held_out_fraction: float = 0.1) -> DataConfig:
    """A DataConfig over JSONL files: one (name, path, weight) per source."""
    return DataConfig(
        sources=tuple(DataSource(name=n, kind="jsonl", path=str(p), weight=w) for n, p, w in sources),
        held_out_fraction=held_out_fraction,
    )


def small_corpus_override(directory: Path, documents: int = 400) -> str:
    """A ``data.sources=...`` override for a JSONL corpus of ``documents`` short texts (~60 KB):
    the stdlib corpus would cost a test seconds of tokenization per tokenizer and split."""
    texts = [
        f"document {i}: the quick brown fox {i % 7} jumps over " + "héllo wörld " * (i % 5)
        for i in range(documents)
    ]
    path = write_jsonl(directory / "small_corpus.jsonl", texts)
    return f"data.sources=[{{name: small, kind: jsonl, path: {path}}}]"


def _byte_bpe(vocab_size: int, special_tokens: list[str], texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def train_bpe_tokenizer(path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json (pad/eos/bos = <pad>, </s>, <s>) trained on a few strings."""
    texts = ["hello world", "héllo wörld", "the quick brown fox"] * 10
    _byte_bpe(vocab_size, ["<pad>", "</s>", "<s>"], texts).save(str(path))
    return path


# ChatML with generation blocks, the shape of many published templates (tools listed in the system turn).
CHATML = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>"
    "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer_dir(directory: Path, template: str | None = CHATML) -> Path:
    """A BPE tokenizer.json with ChatML's special tokens and a tokenizer_config.json (with
    ``template`` as its chat_template) that transformers' AutoTokenizer loads."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = ["what is two plus two", "the answer is four", "user assistant system"] * 10
    tok = _byte_bpe(400, ["<pad>", "</s>", "<s>", "<|im_start|>", "<|im_end|>"], texts)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def assert_valid_row(row: dict[str, np.ndarray], seq_len: int, pad_id: int) -> None:
    """The row format of zaya_jax.data.pipeline: shapes, dtypes, segments, targets, masks."""
    assert sorted(row) == sorted(BATCH_KEYS)
    for key in BATCH_KEYS:
        assert row[key].shape == (seq_len,), key
    assert row["loss_mask"].dtype == np.float32
    for key in ("inputs", "targets", "segment_ids", "positions"):
        assert row[key].dtype == np.int32, key
    seg = row["segment_ids"]
    real = seg > 0
    # Padding only at the end; segments numbered 1, 2, 3 ... in order.
    assert np.all(real[: real.sum()]) and not np.any(real[real.sum() :])
    ids = seg[real]
    assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
    np.testing.assert_array_equal(row["loss_mask"], real.astype(np.float32))
    assert np.all(row["inputs"][~real] == pad_id) and np.all(row["targets"][~real] == pad_id)
    # Positions restart at 0 in every segment and count up.
    starts = np.r_[True, seg[1:] != seg[:-1]]
    expected = np.arange(seq_len) - np.maximum.accumulate(np.where(starts, np.arange(seq_len), 0))
    np.testing.assert_array_equal(row["positions"][real], expected[real])
    # Within a segment the target of position t is the input at t + 1.
    same = (seg[:-1] == seg[1:]) & real[:-1]
    np.testing.assert_array_equal(row["targets"][:-1][same], row["inputs"][1:][same])


def pair_stream(rows: Sequence[dict[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """All real (input, target) pairs of ``rows``, in order."""
    inputs = np.concatenate([r["inputs"][r["loss_mask"] > 0] for r in rows])
    targets = np.concatenate([r["targets"][r["loss_mask"] > 0] for r in rows])
    return inputs, targets
