"""Reading prepared data back, verified (what training reads; :mod:`.format` describes the files).

:func:`read_manifest` checks the manifest's format, version and fields; :func:`verify_shards` every
shard's size and sha256 against it (once per process and file version); :func:`open_prepared`
gives random access to the documents (:class:`PreparedDocuments`), checking that the manifest's
tokenizer is the one in use. Every document read afterwards checks that its shard is still the file
verified on open (not removed, replaced or truncated since), so a shard lost mid-run is a
:class:`DataError` naming it, never an empty or wrong document.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from zaya_jax.data.prepared.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_FIELDS,
    READER_OPTIONS,
    SHARD_FIELDS,
    records_in_shard,
)
from zaya_jax.data.sources import DataError
from zaya_jax.data.tokenizers import Tokenizer, same_tokenizer
from zaya_jax.files import InputFileError, read_json, sha256_file

# sha256 of shard files already verified by this process, keyed by (path, size, mtime_ns).
_VERIFIED: dict[tuple[str, int, int], str] = {}
_MANIFEST_FIX = "rerun `zaya data prepare ... --out` into an empty directory"


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
    wrong = [k for k, kind in MANIFEST_FIELDS.items() if not isinstance(manifest.get(k), kind)]
    wrong += [
        f"shards[{i}]"
        for i, shard in enumerate(manifest.get("shards") if isinstance(manifest.get("shards"), list) else [])
        if not isinstance(shard, dict)
        or any(not isinstance(shard.get(k), t) for k, t in SHARD_FIELDS.items())
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
            expected = records_in_shard(self._len, s, self._num_shards)
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
