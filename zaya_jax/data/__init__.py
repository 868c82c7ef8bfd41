"""Tokenizers, document sources, corpus preparation and Grain pipelines.

``sources`` (reading files) -> ``tokenizers`` -> ``prepared`` (ArrayRecord shards: their format,
the reader training uses, the writer of ``zaya data prepare``) -> ``documents`` (token documents
per source and split) -> ``packing`` (rows) -> ``pipeline`` (mixture, batches) -> ``streams``
(batches independent of the process count) -> ``prefetch`` (a thread ahead of training); ``batch``
names the fields of a batch.

The names below load their module on first use (PEP 562): ``zaya data prepare``'s worker
processes import the sources, tokenizers and preparation modules without Grain or JAX."""

from typing import Any

_LAZY = {
    "BATCH_FIELDS": "batch",
    "BATCH_KEYS": "batch",
    "tokenized_documents": "documents",
    "RowIterator": "pipeline",
    "eval_batches": "pipeline",
    "make_row_iterator": "pipeline",
    "next_batch": "pipeline",
    "Prefetcher": "prefetch",
    "open_prepared": "prepared.reader",
    "read_manifest": "prepared.reader",
    "prepare": "prepared.writer",
    "BadDocuments": "sources",
    "DataError": "sources",
    "jsonl_records": "sources",
    "read_documents": "sources",
    "ByteTokenizer": "tokenizers",
    "HFTokenizer": "tokenizers",
    "load_tokenizer": "tokenizers",
}

__all__ = [*_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"zaya_jax.data.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zaya_jax.data' has no attribute {name!r}")
