"""Output directories that appear whole or not at all: built beside their destination, then moved
into place by one rename.

``zaya data prepare`` and ``zaya convert`` write into ``<parent>/.<name>.partial/`` while holding an
exclusive lock (``flock``) on ``<parent>/.<name>.partial.lock``; when everything is written, every
file and directory is fsynced, the staging directory is renamed to ``<parent>/<name>`` (atomic; an
existing *empty* destination directory is replaced), the parent is fsynced and the lock file removed.
A process killed at any moment therefore leaves either no destination (or the empty one it found)
or the complete output, never a half-written directory under the destination's name.

What a killed writer leaves behind, and what the next run of the same command does with it:

- ``.<name>.partial/`` with ``.<name>.partial.lock`` beside it whose lock is free: an unfinished
  output of a writer that died; it is removed and the output written again from the start.
- the same with the lock held: another command is writing it right now; refused.
- ``.<name>.partial/`` without a lock file: removed only when empty (a writer killed between creating
  the lock and the directory leaves neither half); otherwise refused, since nothing proves it is ours.
- ``.<name>.partial.lock`` alone (killed after the rename, before removing it): reused, then removed.

Nothing else is ever deleted. The staging directory sits in the destination's parent, so the
rename never crosses file systems.

Standard library only, in the bottom layer beside :mod:`zaya_jax.files` (atomic files; this module:
atomic directories): ``zaya data prepare`` (``zaya_jax.data.prepared.writer``) and ``zaya convert``
(``zaya_jax.lm.export_hf``, ``zaya_jax.cli``) use it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import filecmp
import os
import shutil
from collections.abc import Callable
from pathlib import Path

PARTIAL = ".partial"
LOCK = ".lock"


class StagingError(FileExistsError):
    """The destination or its staging directory is in a state no writer may touch; the message
    names the path and what to do."""


def staging_path(destination: str | Path) -> Path:
    """``<parent>/.<name>.partial``, where the output of ``destination`` is built."""
    destination = Path(destination)
    return destination.parent / f".{destination.name}{PARTIAL}"


def lock_path(destination: str | Path) -> Path:
    staging = staging_path(destination)
    return staging.with_name(staging.name + LOCK)


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (files first, so the names point at data)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath), directory=True)


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def same_files(a: str | Path, b: str | Path) -> bool:
    """Whether two directory trees hold the same names with the same bytes (hidden names included)."""
    a, b = Path(a), Path(b)
    names_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*"))
    names_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*"))
    if names_a != names_b:
        return False
    for name in names_a:
        pa, pb = a / name, b / name
        if pa.is_dir() != pb.is_dir():
            return False
        if pa.is_file() and not filecmp.cmp(pa, pb, shallow=False):
            return False
    return True


class StagedDirectory:
    """Write a directory beside ``destination`` and move it into place when complete.

    ``with StagedDirectory(dst, "zaya convert") as staged:`` claims the staging directory (clearing
    a stale one, see the module doc) and yields it empty at ``staged.path``; write everything there,
    then call ``staged.publish()`` (or :meth:`publish_or_match`). Leaving the block without
    publishing (an exception) removes the staging directory. ``publish`` raises :class:`StagingError`
    when ``destination`` is a non-empty directory by then.
    """

    def __init__(self, destination: str | Path, command: str):
        self.destination = Path(destination)
        self.command = command
        self.path = staging_path(self.destination)
        self.lock = lock_path(self.destination)
        self._fd: int | None = None
        self.published = False

    # --- claiming -------------------------------------------------------------------------------
    def _acquire(self) -> int:
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StagingError(
                    f"{self.path} is being written by another process right now (it holds {self.lock}); "
                    f"wait for that {self.command} to finish, or stop it and run this command again"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {self.command}\n".encode())
        return fd

    def __enter__(self) -> StagedDirectory:
        parent = self.destination.parent
        parent.mkdir(parents=True, exist_ok=True)
        had_lock = self.lock.exists()
        if self.path.exists() and not had_lock and not is_empty_dir(self.path):
            raise StagingError(
                f"{self.path} exists and is not empty but has no {self.lock.name} beside it, so nothing "
                f"shows it is an unfinished {self.command}; remove it (or move it away) and run the "
                "command again"
            )
        self._fd = self._acquire()
        try:
            if self.path.is_dir() and not self.path.is_symlink():
                # An unfinished output of a writer that died (its lock was free): start again.
                shutil.rmtree(self.path)
            elif self.path.exists() or self.path.is_symlink():
                raise StagingError(
                    f"{self.path} is not a directory; remove it and run the {self.command} again"
                )
            self.path.mkdir()
        except BaseException:
            self._release()
            raise
        return self

    # --- finishing ------------------------------------------------------------------------------
    def publish(self) -> Path:
        """Make the staged directory the destination (one rename); returns the destination."""
        _fsync_tree(self.path)
        if self.destination.exists() and not is_empty_dir(self.destination):
            raise StagingError(
                f"{self.destination} exists and is not empty; {self.command} never overwrites: choose a "
                "new destination or delete it"
            )
        try:
            os.rename(self.path, self.destination)  # atomic; replaces an empty directory
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise StagingError(
                    f"{self.destination} appeared while {self.command} was writing ({err.strerror}); "
                    "nothing was overwritten: choose a new destination or delete it"
                ) from None
            raise
        _fsync_path(self.destination.parent, directory=True)
        self.published = True
        return self.destination

    def publish_or_match(self, same: Callable[[Path, Path], bool]) -> bool:
        """Publish, unless the destination already holds an output that ``same(staged, existing)``
        finds identical (a rerun of a command that had finished): then the staged copy is dropped.
        Returns whether it published; a different non-empty destination raises :class:`StagingError`."""
        if (
            self.destination.is_dir()
            and not is_empty_dir(self.destination)
            and same(self.path, self.destination)
        ):
            self.discard()
            return False
        self.publish()
        return True

    def discard(self) -> None:
        """Remove the staging directory (its output is not needed: the destination already holds it)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def _release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.lock.unlink()
        os.close(self._fd)
        self._fd = None

    def __exit__(self, *exc: object) -> None:
        try:
            if not self.published:
                self.discard()
        finally:
            self._release()
