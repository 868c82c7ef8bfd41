"""Read documents (strings) from a :class:`~zaya_jax.config.DataSource`.

Kinds: ``text`` (a file, a directory walked recursively, or a glob; one document per file),
``jsonl`` (one JSON object per line, the text in field ``text_field``), ``parquet`` (column
``text_field``), ``stdlib`` (the built-in corpus, :mod:`zaya_jax.data.corpus`). Prepared token
shards (``arrayrecord``) hold tokens, not text; :mod:`zaya_jax.data.prepared.reader` reads them.

Every document has a key, stable across machines, that decides its train/held-out split: the file's
POSIX path relative to the source root (``text``, ``stdlib``), plus ``:line`` (``jsonl``) or
``#row`` (``parquet``). Files are read in sorted key order, so document order is deterministic.

Bad data (an unreadable file, bytes that are not strict UTF-8, a malformed JSON line, a missing or
non-string field) raises :class:`DataError` naming the file (and line), unless
``on_bad_document="skip"``: then the document (or the whole file, when the file itself cannot be
read) is skipped and counted. A source without any document is always an error. Empty documents
(no text) are dropped silently: they carry no tokens.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal

try:
    from zstandard import ZstdError
except ImportError:  # the optional [zst] extra

    class ZstdError(Exception):  # type: ignore[no-redef]
        pass


from zaya_jax.config import DataSource
from zaya_jax.config.data import BUILT_IN
from zaya_jax.data import corpus
from zaya_jax.data.passkey import passkey_documents

logger = logging.getLogger(__name__)

OnBadDocument = Literal["error", "skip"]

_GLOB_CHARS = frozenset("*?[")
# Kind of each input of `zaya data prepare`, by file extension (after a compression suffix);
# anything else is text.
_KIND_BY_SUFFIX = {".jsonl": "jsonl", ".parquet": "parquet"}
# Text and JSONL files may be compressed: gzip (standard library) or zstandard (``zstandard``).
COMPRESSED = (".gz", ".zst")
# Files a directory of a given kind contributes (text: every non-hidden file).
_PATTERN_BY_KIND = {
    "text": "*",
    "jsonl": "*.jsonl*",
    "chat": "*.jsonl*",
    "preference": "*.jsonl*",
    "parquet": "*.parquet",
}
# What reading a (possibly compressed) file raises when the file is unreadable, truncated or corrupt.
_READ_ERRORS = (OSError, EOFError, ZstdError, zlib.error)
PROBLEMS_KEPT = 20
_SKIP_HINT = (
    "or set data.on_bad_document=skip (zaya data prepare --on-bad-document skip) to skip and count bad "
    "documents"
)


def _read_fix(err: BaseException) -> str:
    """What to do about a file that could not be read, by what went wrong."""
    if isinstance(err, PermissionError):
        return "fix its permissions or remove it"
    if isinstance(err, (EOFError, ZstdError, gzip.BadGzipFile, zlib.error)):
        return "it is truncated or corrupt (a partial download or copy?): replace it or remove it"
    return "check that it is a readable file, or remove it"


class DataError(ValueError):
    """Input data that cannot be used as it is; the message names the file and what to change."""


class BadDocuments:
    """Applies the ``on_bad_document`` policy: raise, or count and remember the first problems."""

    def __init__(self, policy: OnBadDocument = "error"):
        if policy not in ("error", "skip"):
            raise DataError(f"on_bad_document={policy!r} is not allowed; use 'error' or 'skip'")
        self.policy = policy
        self.count = 0
        self.problems: list[str] = []

    def report(self, problem: str, fix: str) -> None:
        """One bad document (or unreadable file): ``problem`` says what, ``fix`` what to change."""
        if self.policy == "error":
            raise DataError(f"{problem}; {fix}, {_SKIP_HINT}")
        self.count += 1
        if len(self.problems) < PROBLEMS_KEPT:
            self.problems.append(problem)


@dataclasses.dataclass(frozen=True)
class Documents:
    """All documents of one source, in order: ``keys[i]`` names ``texts[i]`` (see module doc);
    ``skipped`` bad documents were left out, the first of them described in ``problems``."""

    keys: list[str]
    texts: list[str]
    skipped: int
    problems: list[str]


def source_for_path(
    path: str | Path, name: str | None = None, text_field: str = "text", data_format: str = "auto"
) -> DataSource:
    """A :class:`DataSource` for one input of ``zaya data prepare`` or ``zaya eval --data``:
    ``*.jsonl`` (also ``.jsonl.gz``, ``.jsonl.zst``) -> jsonl with the field ``text_field``, or chat
    when its first record has a ``messages`` field and no ``text_field`` (``data_format="auto"``) or
    when ``data_format="chat"``, or preference when it has ``chosen`` and ``rejected``; ``*.parquet`` -> parquet (also as the last part of a glob); anything
    else (files, directories, globs) -> text."""
    if data_format not in ("auto", "text", "chat"):
        raise DataError(f"format {data_format!r} is unknown; use 'auto', 'text' or 'chat'")
    text = str(path)
    stem = Path(text.removesuffix(".gz").removesuffix(".zst"))
    kind = _KIND_BY_SUFFIX.get(stem.suffix.lower(), "text")
    first = _first_record(text) if data_format == "auto" and kind == "jsonl" else None
    if first is not None and "chosen" in first and "rejected" in first and text_field not in first:
        kind = "preference"
    elif data_format == "chat" or (first is not None and "messages" in first and text_field not in first):
        kind = "chat"
    source = DataSource(name=name or text, kind=kind, path=text, text_field=text_field)  # type: ignore[arg-type]
    if kind == "chat":
        resolve_files(source)  # a chat source is JSONL: name the problem now, not at the first read
    return source


def _first_record(path: str) -> dict | None:
    """The first record of the first JSONL file of ``path`` (None: not JSONL, or unreadable:
    reading it reports the problem)."""
    try:
        files = resolve_files(DataSource(name=path, kind="jsonl", path=path))
        with open_bytes(files[0][1]) as f:
            for raw in f:
                if raw.strip():
                    record = json.loads(raw)
                    return record if isinstance(record, dict) else None
    except (DataError, ValueError, *_READ_ERRORS):
        return None
    return None


def open_bytes(path: Path) -> IO[bytes]:
    """A binary file, decompressed on the fly when it ends in ``.gz`` or ``.zst``."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(
                f"{path} is zstandard-compressed; pip install zstandard (or the zaya-jax[zst] extra), or "
                "decompress it"
            ) from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True))
    return path.open("rb")


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _walk(root: Path, pattern: str) -> list[tuple[str, Path]]:
    """Files under ``root`` matching ``pattern`` (hidden files and directories left out, since they
    are editor and VCS state, not corpus text) as (relative POSIX key, path)."""
    found = []
    for path in root.rglob(pattern):
        rel = path.relative_to(root)
        if not _is_hidden(rel) and path.is_file():
            found.append((rel.as_posix(), path))
    return found


def _glob_root(pattern: str) -> Path:
    """The directory part of a glob before its first wildcard: keys are relative to it."""
    parts = Path(pattern).parts
    fixed = []
    for part in parts:
        if _GLOB_CHARS.intersection(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def resolve_files(source: DataSource) -> list[tuple[str, Path]]:
    """The files of a ``text``/``jsonl``/``parquet`` source as (key, path), sorted by key.

    A directory is walked recursively (``jsonl``/``parquet``: files with that extension); a glob
    (``**`` allowed) is expanded and directories it matches are walked.
    """
    if not source.path:
        raise DataError(f"data source {source.name!r} of kind {source.kind!r} needs a path")
    text = str(Path(source.path).expanduser())
    pattern = _PATTERN_BY_KIND[source.kind]
    if _GLOB_CHARS.intersection(text):
        root = _glob_root(text)
        found = {}
        for match in sorted(glob.glob(text, recursive=True)):
            path = Path(match)
            if path.is_dir():
                for key, sub in _walk(path, pattern):
                    found[(path.relative_to(root) / key).as_posix()] = sub
            elif path.is_file():
                found[path.relative_to(root).as_posix()] = path
        if not found:
            raise DataError(
                f"data source {source.name!r}: the pattern {text!r} matches no files; check the path"
            )
        return sorted(found.items())
    path = Path(text)
    if path.is_dir():
        files = _walk(path, pattern)
        if not files:
            what = "files" if source.kind == "text" else f"{pattern} files"
            raise DataError(f"data source {source.name!r}: the directory {path} holds no {what}")
        return sorted(files)
    if path.exists():
        return [(path.name, path)]
    raise DataError(f"data source {source.name!r}: {path} does not exist; check the source's path")


def _decode(data: bytes, where: str, bad: BadDocuments) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        bad.report(
            f"{where} is not valid UTF-8 (byte {err.start}: {err.reason})",
            "convert it to UTF-8 or remove it",
        )
        return None


def text_documents(files: list[tuple[str, Path]], bad: BadDocuments) -> Iterator[tuple[str, str]]:
    for key, path in files:
        try:
            if path.name.endswith(COMPRESSED):
                with open_bytes(path) as f:
                    data = f.read()
            else:
                data = path.read_bytes()
        except _READ_ERRORS as err:
            bad.report(
                f"cannot read {path} ({getattr(err, 'strerror', None) or err})",
                _read_fix(err),
            )
            continue
        text = _decode(data, str(path), bad)
        if text:
            yield key, text


def iter_records(files: list[tuple[str, Path]], bad: BadDocuments) -> Iterator[tuple[str, str, dict]]:
    """(key ``file:line``, where ``path:line``, object) for every JSON-object line of the JSONL
    ``files``; blank lines are skipped, anything else that is not a JSON object goes to ``bad``."""
    for key, path in files:
        yield from iter_record_range(key, path, bad)


def jsonl_records(
    path: str, bad: BadDocuments, name: str = "records", kind: str = "jsonl"
) -> Iterator[tuple[str, str, dict]]:
    """:func:`iter_records` of every JSONL file ``path`` names (a file, directory or glob, as a
    data source's ``path``): the reader for files that are not a training source (prompts, rollouts).
    ``name`` and ``kind`` describe them in errors; ``bad`` takes the lines that are not JSON objects
    (and the caller's own reports of records it cannot use)."""
    yield from iter_records(resolve_files(DataSource(name=name, kind=kind, path=path)), bad)


def iter_record_range(
    key: str, path: Path, bad: BadDocuments, start: int = 0, end: int | None = None, first_line: int = 1
) -> Iterator[tuple[str, str, dict]]:
    """:func:`iter_records` of one file, or of the lines of an uncompressed file that begin in bytes
    ``[start, end)`` (``start`` at a line start, which is line ``first_line``): how ``zaya data
    prepare`` splits a large file over workers (:mod:`zaya_jax.data.prepared.work`)."""
    line_no = first_line - 1
    try:
        with open_bytes(path) as f:
            if start:
                f.seek(start)
            offset = start
            for raw in f:
                if end is not None and offset >= end:
                    break
                offset += len(raw)
                line_no += 1
                if not raw.strip():
                    continue
                where = f"{path}:{line_no}"
                line = _decode(raw, where, bad)
                if line is None:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    bad.report(f"{where}: not valid JSON ({err.msg})", "fix or delete the line")
                    continue
                if not isinstance(record, dict):
                    bad.report(
                        f"{where}: a JSON {type(record).__name__}, not an object",
                        "write one JSON object per line",
                    )
                    continue
                yield f"{key}:{line_no}", where, record
    except _READ_ERRORS as err:
        at = f" after line {line_no}" if line_no >= first_line else ""
        bad.report(
            f"cannot read {path}{at} ({getattr(err, 'strerror', None) or err})",
            _read_fix(err),
        )


def _jsonl_documents(
    files: list[tuple[str, Path]], field: str, bad: BadDocuments
) -> Iterator[tuple[str, str]]:
    return record_texts(iter_records(files, bad), field, bad)


def record_texts(
    records: Iterator[tuple[str, str, dict]], field: str, bad: BadDocuments
) -> Iterator[tuple[str, str]]:
    """(key, text) of JSONL ``records`` (:func:`iter_records`): their string field ``field``."""
    for key, where, record in records:
        if field not in record:
            bad.report(
                f"{where}: no field {field!r} (fields: {', '.join(map(repr, record)) or 'none'})",
                "set the source's text_field to the field holding the text",
            )
            continue
        value = record[field]
        if not isinstance(value, str):
            bad.report(
                f"{where}: field {field!r} is a {type(value).__name__}, not a string",
                "store the document text as a JSON string",
            )
            continue
        if value:
            yield key, value


def parquet_documents(
    files: list[tuple[str, Path]], field: str, bad: BadDocuments
) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for key, path in files:
        try:
            parquet = pq.ParquetFile(path)
            schema = parquet.schema_arrow
        except (OSError, pa.ArrowException) as err:
            bad.report(
                f"cannot read {path} as Parquet ({err})", "rewrite it as a valid Parquet file or remove it"
            )
            continue
        if field not in schema.names:
            bad.report(
                f"{path}: no column {field!r} (columns: {', '.join(map(repr, schema.names))})",
                "set the source's text_field to the column holding the text",
            )
            continue
        column_type = schema.field(field).type
        is_binary = pa.types.is_binary(column_type) or pa.types.is_large_binary(column_type)
        if not (is_binary or pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            bad.report(
                f"{path}: column {field!r} has type {column_type}, not string",
                "store the document text as a string column",
            )
            continue
        row = 0
        try:
            for batch in parquet.iter_batches(columns=[field], batch_size=1024):
                for value in batch.column(0).to_pylist():
                    where = f"{path} row {row}"
                    if value is None:
                        bad.report(f"{where}: {field!r} is null", "drop the row or fill in its text")
                    elif is_binary:
                        text = _decode(value, where, bad)
                        if text:
                            yield f"{key}#{row}", text
                    elif value:
                        yield f"{key}#{row}", value
                    row += 1
        except (OSError, pa.ArrowException) as err:
            bad.report(
                f"cannot read {path} after row {row} ({err})",
                "rewrite it as a valid Parquet file or remove it",
            )


def stdlib_documents(bad: BadDocuments) -> Iterator[tuple[str, str]]:
    keys, texts, skipped = corpus.read_stdlib()
    # Undecodable stdlib files are skipped under either policy (see corpus.read_stdlib).
    bad.count += len(skipped)
    bad.problems.extend(f"{corpus.stdlib_root() / key} is not valid UTF-8" for key in skipped)
    yield from zip(keys, texts, strict=True)


def built_in_documents(source: DataSource, bad: BadDocuments) -> Iterator[tuple[str, str]]:
    """The documents of a built-in kind (``stdlib``, ``passkey``: no path)."""
    return stdlib_documents(bad) if source.kind == "stdlib" else passkey_documents()


def iter_documents(source: DataSource, bad: BadDocuments | None = None) -> Iterator[tuple[str, str]]:
    """(key, text) for every document of ``source``, in order; bad documents go to ``bad``
    (default: raise). Raises :class:`DataError` at the end when the source held no document."""
    bad = BadDocuments() if bad is None else bad
    if source.kind in BUILT_IN:
        documents = built_in_documents(source, bad)
    elif source.kind == "text":
        documents = text_documents(resolve_files(source), bad)
    elif source.kind == "jsonl":
        documents = _jsonl_documents(resolve_files(source), source.text_field, bad)
    elif source.kind == "parquet":
        documents = parquet_documents(resolve_files(source), source.text_field, bad)
    else:
        raise DataError(
            f"data source {source.name!r} of kind {source.kind!r} holds tokens, not text; "
            "read it with zaya_jax.data.open_prepared"
        )
    count = 0
    for item in documents:
        count += 1
        yield item
    if count == 0:
        where = f" ({source.path})" if source.path else ""
        if bad.count:
            detail = f"all {bad.count} bad documents were skipped; the first: {bad.problems[0]}"
        else:
            detail = "the files hold no text"
        raise DataError(f"data source {source.name!r}{where} has no documents: {detail}")


def read_documents(source: DataSource, on_bad_document: OnBadDocument = "error") -> Documents:
    """Every document of ``source`` in memory (see :func:`iter_documents`)."""
    bad = BadDocuments(on_bad_document)
    keys, texts = [], []
    for key, text in iter_documents(source, bad):
        keys.append(key)
        texts.append(text)
    if bad.count:
        # The built-in corpus always has a few non-UTF-8 test files; that is expected, not news.
        log = logger.info if source.kind == "stdlib" else logger.warning
        log(
            "data source %r: skipped %d bad documents, e.g. %s",
            source.name,
            bad.count,
            "; ".join(bad.problems[:3]),
        )
    return Documents(keys=keys, texts=texts, skipped=bad.count, problems=list(bad.problems))


def file_signature(source: DataSource) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime_ns) of every file of ``source``: changes when its files change, so an
    in-memory cache of tokenized documents can tell when it is stale."""
    if source.kind in BUILT_IN:  # the interpreter's files and generated ones do not change in a process
        return ((source.kind, 0, 0),)
    signature = []
    for _, path in resolve_files(source):
        try:
            stat = path.stat()
        except OSError:
            signature.append((str(path), -1, -1))
        else:
            signature.append((str(path), stat.st_size, stat.st_mtime_ns))
    return tuple(signature)
