"""Tokenizers, document sources, corpus preparation and Grain pipelines.

``sources`` (reading files) -> ``tokenizers`` -> ``prepare`` (ArrayRecord shards) -> ``documents``
(token documents per source and split) -> ``packing`` (rows) -> ``pipeline`` (mixture, batches)
-> ``prefetch`` (a thread ahead of training); ``batch`` names the fields of a batch."""

from zaya_jax.data.batch import BATCH_FIELDS, BATCH_KEYS, batch_fields
from zaya_jax.data.documents import tokenized_documents
from zaya_jax.data.pipeline import RowIterator, eval_batches, make_row_iterator, next_batch
from zaya_jax.data.prefetch import Prefetcher
from zaya_jax.data.prepare import open_prepared, prepare, read_manifest
from zaya_jax.data.sources import DataError, read_documents
from zaya_jax.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BATCH_FIELDS",
    "BATCH_KEYS",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "Prefetcher",
    "RowIterator",
    "batch_fields",
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
