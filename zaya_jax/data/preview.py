"""Packed rows of prepared data as a person reads them (``zaya inspect DATA_DIR --rows N``).

The rows are the ones training builds from the directory (the same packer, in document order, no
shuffle): each segment's text decoded, with the trained targets (``loss_mask`` 1) between
:data:`TRAINED_OPEN` and :data:`TRAINED_CLOSE`, so a chat preparation shows exactly which tokens its
assistant-only loss covers. EOS targets appear as ``[EOS]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from zaya_jax.data.packing import packed_rows
from zaya_jax.data.prepared.reader import open_prepared
from zaya_jax.data.tokenizers import Tokenizer, load_tokenizer

TRAINED_OPEN, TRAINED_CLOSE = "«", "»"


def preview_rows(
    directory: str | Path, num_rows: int, seq_len: int
) -> tuple[list[dict[str, np.ndarray]], Tokenizer]:
    """The first ``num_rows`` packed rows of ``seq_len`` pairs of a prepared directory, and its tokenizer."""
    if num_rows < 1 or seq_len < 1:
        raise ValueError(f"--rows {num_rows} and --seq-len {seq_len} must both be >= 1")
    manifest_tokenizer = open_prepared(directory).manifest["tokenizer"]
    tokenizer = load_tokenizer("byte" if manifest_tokenizer["kind"] == "byte" else manifest_tokenizer["path"])
    documents = open_prepared(directory, tokenizer)
    rows_ds = packed_rows(
        documents,
        seq_len=seq_len,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        seed=0,
        shuffle=False,
        repeat=False,
    )
    rows = []
    for row in rows_ds:
        rows.append(row)
        if len(rows) == num_rows:
            break
    return rows, tokenizer


def _decode(tokenizer: Tokenizer, ids: np.ndarray) -> str:
    """Ids as text, each EOS shown as ``[EOS]``."""
    pieces, start = [], 0
    for i in np.flatnonzero(ids == tokenizer.eos_id):
        pieces.append(tokenizer.decode(ids[start:i]) + "[EOS]")
        start = int(i) + 1
    pieces.append(tokenizer.decode(ids[start:]))
    return "".join(pieces)


def row_text(row: dict[str, np.ndarray], tokenizer: Tokenizer) -> list[str]:
    """Each segment of a packed row as text: its first input, then its targets, the trained runs
    marked."""
    out = []
    segments = row["segment_ids"]
    for segment in [s for s in np.unique(segments) if s > 0]:
        at = np.flatnonzero(segments == segment)
        targets, trained = row["targets"][at], row["loss_mask"][at] > 0
        text = [_decode(tokenizer, row["inputs"][at[:1]])]
        edges = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
        for run in np.split(np.arange(len(at)), edges):
            piece = _decode(tokenizer, targets[run])
            text.append(f"{TRAINED_OPEN}{piece}{TRAINED_CLOSE}" if trained[run[0]] else piece)
        out.append("".join(text))
    return out


def row_summary(row: dict[str, np.ndarray]) -> dict[str, Any]:
    """A packed row as JSON: tokens (inputs), targets, segment ids, loss mask and counts."""
    return {
        "tokens": row["inputs"].tolist(),
        "targets": row["targets"].tolist(),
        "segment_ids": row["segment_ids"].tolist(),
        "loss_mask": row["loss_mask"].astype(int).tolist(),
        "segments": len(np.unique(row["segment_ids"][row["segment_ids"] > 0])),
        "trained": int(row["loss_mask"].sum()),
        "padding": int((row["segment_ids"] == 0).sum()),
    }
