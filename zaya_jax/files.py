"""Durable files: the one atomic write, the one ``events.jsonl`` line writer, the one sha256, and the
one reader of JSON inputs whose errors name the file and line.

The bottom layer of the package (standard library only), so the config, data, interop, resilience
and training code all write files the same way: a reader never sees half a file, and a crash right
after a write returns never loses it (the file and its directory entry are fsynced).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

EVENTS = "events.jsonl"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a directory that cannot be opened (some platforms); the rename stands
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", *, durable: bool = True) -> Iterator[IO[Any]]:
    """Open ``path.<pid>-<thread>.tmp`` for writing; on a clean exit flush, fsync (unless
    ``durable=False``: a file rewritten every step, such as the heartbeat) and rename it over
    ``path``, then fsync the directory. On an exception the temporary file is removed and ``path``
    is left as it was. The temporary name is the writer's own: hosts writing the same file at once
    (every host of ``zaya data prepare`` writes its plan) each rename a whole file of their own,
    where one shared ``path.tmp`` was renamed away under the other writer."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with tmp.open(mode) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.filename is None:  # a failed write() names no file: name the one being replaced
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def write_atomic(path: str | Path, data: str | bytes, *, durable: bool = True) -> Path:
    """Replace ``path`` by ``data`` atomically (and durably; see :func:`atomic_file`)."""
    with atomic_file(path, "wb" if isinstance(data, bytes) else "w", durable=durable) as f:
        f.write(data)
    return Path(path)


def filter_jsonl(path: str | Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    """Drop, atomically, the lines of a JSON-lines file whose record fails ``keep(record)``. A line
    that is not a JSON object ``keep`` can judge (torn, damaged, another tool's) is kept as it is:
    only records known to be dropped are dropped."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            drop = not keep(json.loads(line))
        except (ValueError, TypeError, KeyError, AttributeError):  # not JSON, not UTF-8, not a record
            drop = False
        if not drop:
            kept.append(line + b"\n")
    write_atomic(path, b"".join(kept))


def event_line(name: str, step: int | None, detail: dict[str, Any]) -> str:
    """One ``events.jsonl`` line: ``{"time", "event", "step", "detail"}``."""
    line = {"time": time.time(), "event": name, "step": step, "detail": detail}
    return json.dumps(line, default=str) + "\n"


def append_event(run_dir: str | Path, name: str, step: int | None, detail: dict[str, Any]) -> None:
    """Append one event to ``<run_dir>/events.jsonl`` (opened and closed: for rare writers such as
    the supervisor and the hang watchdog; the trainer keeps the file open)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / EVENTS).open("a") as f:
        f.write(event_line(name, step, detail))


class InputFileError(ValueError):
    """A file the command reads is missing, not text, not valid JSON or of the wrong shape; the
    message names the file (and the line) and the fix."""


def read_text_file(path: str | Path, what: str, fix: str) -> str:
    """The UTF-8 text of ``path``, or an :class:`InputFileError` naming it, ``what`` it is and ``fix``."""
    path = Path(path)
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        state = "a broken link" if path.is_symlink() else "missing"
        raise InputFileError(f"{path} ({what}) is {state}; {fix}") from None
    except IsADirectoryError:
        raise InputFileError(f"{path} ({what}) is a directory, not a file; {fix}") from None
    except UnicodeDecodeError as err:
        raise InputFileError(
            f"{path} ({what}) is not UTF-8 text (byte {err.start} of the file); {fix}"
        ) from None


def read_json(
    path: str | Path, what: str, fix: str = "restore it from a copy or write it again", kind: type = dict
) -> Any:
    """The JSON in ``path`` (a ``kind``: an object by default), or an :class:`InputFileError`
    naming the file, the line and column, ``what`` it is and ``fix``."""
    text = read_text_file(path, what, fix)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputFileError(
            f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno}) in {what}; {fix}"
        ) from None
    if not isinstance(data, kind):
        expected = {dict: "an object", list: "a list"}.get(kind, kind.__name__)
        raise InputFileError(f"{path} ({what}) holds a JSON {_json_type(data)}, not {expected}; {fix}")
    return data


def _json_type(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB pieces."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


_STORAGE_FIXES = {
    errno.ENOSPC: "free space on that file system, or point run.dir (or the output) at one with room",
    errno.EDQUOT: "raise the disk quota, free space, or point run.dir (or the output) elsewhere",
    errno.EROFS: "remount it read-write, or point run.dir (or the output) at a writable directory",
    errno.EACCES: "check the directory's owner and permissions, or point run.dir (or the output) elsewhere",
    errno.EPERM: "check the directory's owner and permissions, or point run.dir (or the output) elsewhere",
}


def storage_error_message(err: OSError) -> str:
    """A one-line explanation of a failed file operation: the path, the cause, the fix, and that
    nothing committed was lost (every write here is atomic: the old file stays until the new one
    is complete)."""
    where = f" {str(err.filename).removesuffix('.tmp')}" if err.filename else ""
    fix = _STORAGE_FIXES.get(err.errno, "fix the storage problem")
    return (
        f"cannot write{where}: {err.strerror or err}. {fix}. Files and checkpoints written before are "
        "intact: rerun the same command (zaya train resumes from its latest complete checkpoint)"
    )
