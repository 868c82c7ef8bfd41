"""Corpus preparation: tokenize documents once into ArrayRecord shards, and read them back verified.

A prepared directory holds ``num_shards`` files ``shard-SSSSS-of-NNNNN.array_record`` and
``manifest.json``. Each record is one document's token ids (no EOS: the pipeline appends it) as
little-endian ``uint16`` (every id < 2**16) or ``uint32``. Documents are dealt round-robin: document
``i`` is record ``i // num_shards`` of shard ``i % num_shards``, so reading the shards back gives
the documents in input order and shards differ in size by at most one document. Chat data
(``"content": "chat"`` in the manifest, :mod:`zaya_jax.data.chat`) stores each conversation as its
ids followed by as many 0/1 trained flags, read back as a (2, n) array; the manifest names the chat
template (origin, sha256).

The whole directory is written beside the destination and renamed into place when complete
(:mod:`zaya_jax.staging`): a killed preparation leaves no output directory (only a hidden
``.<name>.partial`` that the next run of the same command removes, and its finished work, which
that run keeps: :mod:`zaya_jax.data.prepare_work` spreads the work over hosts and worker
processes and resumes it), and the manifest is written last,
so a directory without ``manifest.json`` is never read. A rerun of a preparation that had finished
prepares again and succeeds when the result is byte-identical to what is there (the manifest holds
no time or other varying field), and refuses otherwise. Reading verifies every shard's size and
sha256 against the manifest and that the manifest's tokenizer is the one in use; every document read
afterwards checks that its shard is still the file verified on open (not removed, replaced or
truncated since), so a shard lost mid-run is a :class:`DataError` naming it, never an empty or wrong
document.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from zaya_jax.config import DataSource
from zaya_jax.data.chat import ChatEncoder, find_chat_template_for
from zaya_jax.data.prepare_work import (
    CHUNK_BYTES,
    READER_OPTIONS,
    Job,
    Workers,
    open_work,
    piece_stats,
    plan_of,
    plan_units,
    source_totals,
    wait_for_pieces,
    write_piece,
    write_shard,
)
from zaya_jax.data.sources import DataError, OnBadDocument, source_for_path
from zaya_jax.data.tokenizers import Tokenizer, load_tokenizer, same_tokenizer, token_dtype
from zaya_jax.files import InputFileError, read_json, sha256_file, write_atomic
from zaya_jax.staging import StagedDirectory, StagingError, is_empty_dir, same_files

FORMAT = "zaya-jax-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# sha256 of shard files already verified by this process, keyed by (path, size, mtime_ns).
_VERIFIED: dict[tuple[str, int, int], str] = {}


def shard_name(index: int, num_shards: int) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}.array_record"


def _check_out_dir(out: Path) -> None:
    """Refuse anything but a new directory, an empty one, or an earlier complete preparation (whose
    bytes must then match this one's; see :func:`prepare`)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"output directory {out} is a file; give a new directory for the prepared shards")
    if not is_empty_dir(out) and not (out / MANIFEST).is_file():
        raise DataError(
            f"output directory {out} already exists and is not empty; prepare never overwrites data: "
            "choose a new directory or delete this one"
        )


def prepare(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer_spec: str = "byte",
    num_shards: int = 4,
    on_bad_document: OnBadDocument = "error",
    text_field: str = "text",
    data_format: str = "auto",
    chat_template: str | None = None,
    *,
    workers: int = 1,
    num_hosts: int = 1,
    host_index: int = 0,
    unit_bytes: int = CHUNK_BYTES,
    wait_s: float = 24 * 3600.0,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Tokenize the documents of ``inputs`` into ``num_shards`` ArrayRecord shards in ``out_dir``.

    ``inputs``: text files, directories (every file a document) or globs, ``*.jsonl`` files (field
    ``text_field``) and ``*.parquet`` files (column ``text_field``); the kind follows the extension,
    and text and JSONL files may be ``.gz`` or ``.zst`` compressed. ``data_format="chat"`` (or
    ``"auto"`` with JSONL records holding ``messages``) reads conversations instead, rendered with
    ``chat_template`` (a file) or the tokenizer's template; one preparation holds text or chats, not
    both. Returns the manifest (also written to ``out_dir/manifest.json``).

    ``workers`` processes tokenize on this host; ``num_hosts`` hosts may share the work, each
    running this with its ``host_index`` (:mod:`zaya_jax.data.prepare_work`): host 0 waits up to
    ``wait_s`` for the others, writes the shards and returns the manifest, the others return
    ``{"host_index", "units"}`` once their part is done. Work is cut into units of a file, or of
    ``unit_bytes`` of a large JSONL file. The output is byte-identical whatever the split, and a killed preparation rerun with the same command redoes only unfinished work.
    ``progress(what, done, total)`` is called as units and shards finish.

    ``out_dir`` appears complete or not at all (see the module doc). When ``out_dir`` already holds
    a finished preparation, it is prepared again beside it: a byte-identical result leaves it as it
    is and succeeds; a different one is refused.
    """
    _check_arguments(inputs, num_shards, workers, num_hosts, host_index)
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = token_dtype(tokenizer.vocab_size).newbyteorder("<")
    out = Path(out_dir)
    sources = [source_for_path(item, text_field=text_field, data_format=data_format) for item in inputs]
    sources = [dataclasses.replace(s, chat_template=chat_template) for s in sources]
    encoder = _chat_encoder(sources, tokenizer)
    settings = {
        "tokenizer": tokenizer.spec,
        "num_shards": num_shards,
        "on_bad_document": on_bad_document,
        "template": encoder.template.sha256 if encoder else None,
    }
    units = plan_units(sources, unit_bytes)
    report = progress or (lambda what, done, total: None)
    if host_index != 0:
        work = open_work(out, plan_of(sources, units, settings), primary=False)
        job = Job(sources, units, num_shards, dtype.name, on_bad_document, work)
        mine = [(i,) for i in range(host_index, len(units), num_hosts)]
        with Workers(job, functools.partial(_tools, tokenizer_spec, sources), workers) as pool:
            pool.map(write_piece, mine, lambda d, t: report("units", d, t))
        return {"host_index": host_index, "units": len(mine)}
    _check_out_dir(out)
    try:
        with StagedDirectory(out, "zaya data prepare") as staged:
            work = open_work(out, plan_of(sources, units, settings), primary=True)
            job = Job(sources, units, num_shards, dtype.name, on_bad_document, work)
            try:
                tools = functools.partial(_tools, tokenizer_spec, sources)
                manifest = _prepare_primary(
                    job, staged.path, tools, tokenizer, workers, num_hosts, wait_s, report
                )
                if not staged.publish_or_match(same_files):
                    verify_shards(out, read_manifest(out))
            except Exception:
                if num_hosts == 1:  # a failure, not a kill: nothing to resume (the inputs must change)
                    shutil.rmtree(work, ignore_errors=True)
                raise
            shutil.rmtree(work, ignore_errors=True)
    except StagingError as err:
        raise DataError(str(err)) from None
    return manifest


def _check_arguments(
    inputs: Sequence[Any], num_shards: int, workers: int, num_hosts: int, host_index: int
) -> None:
    if not inputs:
        raise DataError("no inputs given; name the text, JSONL or Parquet files (or directories) to prepare")
    for name, value in (("num_shards", num_shards), ("workers", workers), ("num_hosts", num_hosts)):
        if value < 1:
            raise DataError(f"{name}={value} must be >= 1")
    if not 0 <= host_index < num_hosts:
        raise DataError(f"host_index={host_index} must be in [0, num_hosts={num_hosts})")


def _tools(tokenizer_spec: str, sources: Sequence[DataSource]) -> tuple[Tokenizer, ChatEncoder | None]:
    """A worker's tokenizer and chat encoder (built in the worker: neither is picklable)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    return tokenizer, _chat_encoder(sources, tokenizer)


def _prepare_primary(
    job: Job,
    directory: Path,
    tools: Callable[[], tuple[Tokenizer, ChatEncoder | None]],
    tokenizer: Tokenizer,
    workers: int,
    num_hosts: int,
    wait_s: float,
    report: Callable[[str, int, int], None],
) -> dict[str, Any]:
    """Host 0's part: its units, then (every piece done) the shards, moved into ``directory``
    beside the manifest."""
    encoder = _chat_encoder(job.sources, tokenizer)
    with Workers(job, tools, workers) as pool:
        return _primary_phases(job, directory, pool, tokenizer, encoder, num_hosts, wait_s, report)


def _primary_phases(
    job: Job,
    directory: Path,
    pool: Workers,
    tokenizer: Tokenizer,
    encoder: ChatEncoder | None,
    num_hosts: int,
    wait_s: float,
    report: Callable[[str, int, int], None],
) -> dict[str, Any]:
    mine = [(i,) for i in range(0, len(job.units), num_hosts)]
    pool.map(write_piece, mine, lambda d, t: report("units", d, t))
    if num_hosts > 1:
        wait_for_pieces(job, wait_s, lambda d, t: report("units of all hosts", d, t))
    stats = [piece_stats(job, i) for i in range(len(job.units))]  # all done: read back, in order
    totals = source_totals(job, stats)
    for source, total in zip(job.sources, totals, strict=True):
        if total["documents"] == 0:
            raise DataError(_no_documents(source, total))
    counts = [stat["documents"] for stat in stats]
    names = [shard_name(i, job.num_shards) for i in range(job.num_shards)]
    tasks = [(i, counts, names[i], encoder is not None) for i in range(job.num_shards)]
    shards = pool.map(write_shard, tasks, lambda d, t: report("shards", d, t))
    for name in names:
        os.replace(job.shard(name, "array_record"), directory / name)
    inputs = [
        {
            "path": str(source.path),
            "kind": source.kind,
            "documents": total["documents"],
            "skipped_documents": total["skipped"],
            "problems": total["problems"],
        }
        for source, total in zip(job.sources, totals, strict=True)
    ]
    manifest = _manifest(shards, inputs, tokenizer, np.dtype(job.dtype), encoder)
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=2))
    return manifest


def _no_documents(source: DataSource, total: dict[str, Any]) -> str:
    """What reading ``source`` alone says when none of its documents could be used."""
    if source.kind == "chat":
        first = f"; the first problem: {total['problems'][0]}" if total["problems"] else ""
        return f"chat source {source.name!r} ({source.path}) has no conversations{first}"
    where = f" ({source.path})" if source.path else ""
    if total["skipped"]:
        detail = f"all {total['skipped']} bad documents were skipped; the first: {total['problems'][0]}"
    else:
        detail = "the files hold no text"
    return f"data source {source.name!r}{where} has no documents: {detail}"


def _chat_encoder(sources: Sequence[DataSource], tokenizer: Tokenizer) -> ChatEncoder | None:
    """The encoder of a chat preparation, None for text; refuses a mix of the two."""
    kinds = {s.kind == "chat" for s in sources}
    if len(kinds) > 1:
        chats = [s.path for s in sources if s.kind == "chat"]
        raise DataError(
            f"the inputs mix chat conversations ({', '.join(map(str, chats))}) with text; prepare them into "
            "separate directories and list both as data.sources"
        )
    if kinds != {True}:
        if sources and sources[0].chat_template:
            raise DataError(
                "a chat template was given but the inputs are text; give --format chat for chat data"
            )
        return None
    return ChatEncoder(tokenizer, find_chat_template_for(sources[0], tokenizer))


def _manifest(
    shards: list[dict[str, Any]],
    input_stats: list[dict[str, Any]],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    encoder: ChatEncoder | None,
) -> dict[str, Any]:
    """The manifest of written shards (file, records, tokens, bytes, sha256 each): counts,
    tokenizer, the inputs."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.spec,
        "dtype": dtype.name,
        "byte_order": "little",
        "layout": "round_robin",
        "eos_appended": False,
        "shards": [
            {k: shard[k] for k in ("file", "records", "tokens", "bytes", "sha256")} for shard in shards
        ],
        "documents": sum(shard["records"] for shard in shards),
        "tokens": sum(shard["tokens"] for shard in shards),
        "skipped_documents": sum(s["skipped_documents"] for s in input_stats),
        "inputs": input_stats,
    }
    if encoder is not None:
        manifest["content"] = "chat"
        manifest["chat_template"] = {"origin": encoder.template.origin, "sha256": encoder.template.sha256}
    return manifest


_MANIFEST_FIX = "rerun `zaya data prepare ... --out` into an empty directory"
# The manifest's fields that readers use, with their types (a damaged manifest is named, not a traceback).
_MANIFEST_FIELDS = {"tokenizer": dict, "dtype": str, "documents": int, "tokens": int, "shards": list}
_SHARD_FIELDS = {"file": str, "records": int, "tokens": int, "bytes": int, "sha256": str}


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a prepared directory; :class:`DataError` naming the file when it is missing,
    unreadable, of another format, or lists a field or shard of the wrong kind."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not os.path.lexists(path):
        raise DataError(
            f"{path} is missing: {directory} is not a directory written by `zaya data prepare`, or that "
            f"preparation did not finish; {_MANIFEST_FIX}"
        )
    try:
        manifest = read_json(path, "the manifest of prepared data", _MANIFEST_FIX)
    except InputFileError as err:
        raise DataError(str(err)) from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path} is format {manifest.get('format')!r} version {manifest.get('format_version')!r}; this "
            f"zaya-jax reads {FORMAT!r} version {FORMAT_VERSION}: prepare the data again with this version"
        )
    wrong = [k for k, kind in _MANIFEST_FIELDS.items() if not isinstance(manifest.get(k), kind)]
    wrong += [
        f"shards[{i}]"
        for i, shard in enumerate(manifest.get("shards") if isinstance(manifest.get("shards"), list) else [])
        if not isinstance(shard, dict)
        or any(not isinstance(shard.get(k), t) for k, t in _SHARD_FIELDS.items())
    ]
    if wrong or manifest["dtype"] not in ("uint16", "uint32"):
        raise DataError(
            f"{path}: {', '.join(wrong) or 'dtype'} missing or of the wrong type; {_MANIFEST_FIX}"
        )
    for shard in manifest["shards"]:
        if Path(shard["file"]).name != shard["file"] or shard["file"] in (".", ".."):
            raise DataError(f"{path}: shard {shard['file']!r} points outside {directory}; {_MANIFEST_FIX}")
    return manifest


def verify_shards(directory: str | Path, manifest: dict[str, Any]) -> None:
    """Check every shard's presence, size and sha256 against the manifest (cached per process by
    size and modification time, so a verified shard is hashed once)."""
    directory = Path(directory)
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        try:
            stat = path.stat()
        except OSError:
            raise DataError(
                f"shard {path} listed in {directory / MANIFEST} is missing; restore it or prepare the data again"
            ) from None
        if stat.st_size != shard["bytes"]:
            raise DataError(
                f"shard {path} has {stat.st_size} bytes but the manifest says {shard['bytes']}: it was "
                "truncated or modified; restore it or prepare the data again"
            )
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if _VERIFIED.get(key) == shard["sha256"]:
            continue
        digest = sha256_file(path)
        if digest != shard["sha256"]:
            raise DataError(
                f"shard {path} is corrupt: its sha256 {digest[:16]}... differs from the manifest's "
                f"{shard['sha256'][:16]}...; restore it or prepare the data again"
            )
        _VERIFIED[key] = digest


_SHARD_FIX = (
    "restore the file (or prepare the data again with `zaya data prepare`) and rerun the same command: "
    "training resumes from its last complete checkpoint"
)


def _identity(path: Path) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime_ns): changes when a file is removed, replaced, truncated or written."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


class PreparedDocuments:
    """Random access to the documents of a prepared directory, verified on open.

    ``docs[i]`` is document ``i`` (in input order) as a (num_tokens,) array of the manifest's dtype
    (chat data: a (2, num_tokens) array, ids over trained flags).
    """

    def __init__(self, directory: str | Path, tokenizer: Tokenizer | None = None):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        if tokenizer is not None and not same_tokenizer(self.manifest["tokenizer"], tokenizer.spec):
            raise DataError(
                f"{self.directory} was tokenized with {self.manifest['tokenizer']} but the tokenizer in use is "
                f"{tokenizer.spec}; set data.tokenizer to the one the data was prepared with, or prepare it again"
            )
        shards = self.manifest["shards"]
        self._paths = [self.directory / shard["file"] for shard in shards]
        verify_shards(self.directory, self.manifest)
        identities = [_identity(path) for path in self._paths]  # of the files just verified
        self._dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self._num_shards = len(shards)
        self._len = int(self.manifest["documents"])
        self.is_chat = self.manifest.get("content", "text") == "chat"
        for s, shard in enumerate(shards):
            expected = (self._len - s + self._num_shards - 1) // self._num_shards
            if shard["records"] != expected:
                raise DataError(
                    f"{self.directory / MANIFEST} lists {shard['records']} records in {shard['file']} but the "
                    f"round-robin layout of {self._len} documents gives {expected}; prepare the data again"
                )
        self._readers = [ArrayRecordReader(str(path), READER_OPTIONS) for path in self._paths]
        for reader, shard in zip(self._readers, shards, strict=True):
            if reader.num_records() != shard["records"]:
                raise DataError(
                    f"shard {self.directory / shard['file']} holds {reader.num_records()} records but the "
                    f"manifest says {shard['records']}; prepare the data again"
                )
        # Every read checks that its shard is still the file verified and opened here.
        self._identities = identities
        for path, identity in zip(self._paths, identities, strict=True):
            self._check_unchanged(path, identity)

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["tokens"])

    def fingerprint(self) -> str:
        """Names these exact contents (the shard checksums), for checkpointed iterator states."""
        return hashlib.sha256("".join(s["sha256"] for s in self.manifest["shards"]).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if not 0 <= index < self._len:
            raise IndexError(f"document {index} out of range for {self._len} documents")
        shard = index % self._num_shards
        path = self._paths[shard]
        # An open ArrayRecord reader keeps reading a removed file and returns empty records from a
        # truncated one: check the file first, and never hand on an empty record (none is written).
        self._check_unchanged(path, self._identities[shard])
        try:
            (record,) = self._readers[shard].read([index // self._num_shards])
        except Exception as err:
            raise DataError(
                f"reading document {index} from shard {path} failed ({err}); {_SHARD_FIX}"
            ) from None
        if not record:
            raise DataError(
                f"shard {path} returned an empty record for document {index}: the file was truncated or "
                f"overwritten after it was verified; {_SHARD_FIX}"
            )
        values = np.frombuffer(record, dtype=self._dtype)
        return values.reshape(2, -1) if self.is_chat else values

    def _check_unchanged(self, path: Path, identity: tuple[int, int, int, int]) -> None:
        try:
            now = _identity(path)
        except FileNotFoundError:
            raise DataError(
                f"shard {path} was removed after this process verified and opened it; {_SHARD_FIX}"
            ) from None
        if now != identity:
            what = "replaced or modified"
            if now[2] != identity[2]:
                what = (
                    f"{'truncated' if now[2] < identity[2] else 'modified'} ({identity[2]} -> {now[2]} bytes)"
                )
            raise DataError(
                f"shard {path} was {what} after this process verified and opened it; {_SHARD_FIX}"
            )


def open_prepared(directory: str | Path, tokenizer: Tokenizer | None = None) -> PreparedDocuments:
    """Open a prepared directory, verifying its shards and (when given) the tokenizer."""
    return PreparedDocuments(directory, tokenizer)
