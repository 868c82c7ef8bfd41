"""The prepared-data format: what a directory written by ``zaya data prepare`` holds.

A prepared directory holds ``num_shards`` files ``shard-SSSSS-of-NNNNN.array_record``
(:func:`shard_name`) and ``manifest.json`` (:data:`MANIFEST`, written last: a directory without it
is never read). Each record is one document's token ids (no EOS: the pipeline appends it) as
little-endian ``uint16`` (every id < 2**16) or ``uint32``, one record per ArrayRecord chunk
(:data:`WRITER_OPTIONS`), so random access to a document is one read. Documents are dealt
round-robin: document ``i`` is record ``i // num_shards`` of shard ``i % num_shards``, so reading
the shards back gives the documents in input order and shards differ in size by at most one
document (:func:`records_in_shard`). Chat data (``"content": "chat"`` in the manifest,
:mod:`zaya_jax.data.chat`) stores each conversation as its ids followed by as many 0/1 trained
flags, read back as a (2, n) array; the manifest names the chat template (origin, sha256).

The manifest (:func:`manifest_of`) names the format and its version, the tokenizer, the dtype and
layout, every shard (file, records, tokens, bytes, sha256), the totals and the inputs; it holds no
time or other varying field, so the same preparation gives the same bytes. Reading it back is
:mod:`zaya_jax.data.prepared.reader`; writing it, :mod:`zaya_jax.data.prepared.writer`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FORMAT = "zaya-jax-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WRITER_OPTIONS = "group_size:1"  # one record per chunk: random access to a document is one read
READER_OPTIONS = "readahead_buffer_size:0"
# The manifest's fields that readers use, with their types (a damaged manifest is named, not a traceback).
MANIFEST_FIELDS = {"tokenizer": dict, "dtype": str, "documents": int, "tokens": int, "shards": list}
SHARD_FIELDS = {"file": str, "records": int, "tokens": int, "bytes": int, "sha256": str}


def shard_name(index: int, num_shards: int) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}.array_record"


def records_in_shard(documents: int, shard: int, num_shards: int) -> int:
    """How many of ``documents`` documents the round-robin layout deals into shard ``shard``."""
    return (documents - shard + num_shards - 1) // num_shards


def manifest_of(
    shards: list[dict[str, Any]],
    input_stats: list[dict[str, Any]],
    tokenizer_spec: dict[str, Any],
    dtype: np.dtype,
    chat_template: dict[str, str] | None,
) -> dict[str, Any]:
    """The manifest of written shards (file, records, tokens, bytes, sha256 each): counts,
    tokenizer, the inputs; ``chat_template`` (origin, sha256) marks chat content."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer_spec,
        "dtype": dtype.name,
        "byte_order": "little",
        "layout": "round_robin",
        "eos_appended": False,
        "shards": [{k: shard[k] for k in SHARD_FIELDS} for shard in shards],
        "documents": sum(shard["records"] for shard in shards),
        "tokens": sum(shard["tokens"] for shard in shards),
        "skipped_documents": sum(s["skipped_documents"] for s in input_stats),
        "inputs": input_stats,
    }
    if chat_template is not None:
        manifest["content"] = "chat"
        manifest["chat_template"] = chat_template
    return manifest
