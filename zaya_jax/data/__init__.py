"""Tokenizers, document sources, corpus preparation and Grain pipelines (packing, mixtures)."""

from zaya_jax.data.pipeline import (
    Prefetcher,
    RowIterator,
    eval_batches,
    make_row_iterator,
    next_batch,
    tokenized_documents,
)
from zaya_jax.data.prepare import open_prepared, prepare, read_manifest
from zaya_jax.data.sources import DataError, read_documents
from zaya_jax.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "Prefetcher",
    "RowIterator",
    "eval_batches",
    "load_tokenizer",
    "make_row_iterator",
    "next_batch",
    "open_prepared",
    "prepare",
    "read_documents",
    "read_manifest",
    "tokenized_documents",
]
