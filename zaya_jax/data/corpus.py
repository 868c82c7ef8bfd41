"""The built-in corpus: the running interpreter's standard-library Python source (no download).

Test packages are included: without them CPython 3.11's stdlib holds about 12 MB of ``.py`` text,
with them about 31 MB, enough for the tiny and small presets to train for many steps without
repeating. Distributions that strip ``test/`` (Debian's ``python3``) get a smaller corpus, but each
file still lands in the same split, because the split hashes the file's relative path.

Held-out split: a document is held out when a hash of its key (the POSIX path relative to the
stdlib root, for this corpus) maps below ``held_out_fraction``. This is the same on every machine and
monotone in the fraction (a file held out at 2% is also held out at 5%).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

# Third-party packages live inside the stdlib directory; build-configuration modules record the
# paths and compiler flags of the machine that built Python, so they differ between machines.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_EXCLUDED_PREFIXES = ("_sysconfigdata",)
_HASH_SCALE = float(1 << 64)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """Every stdlib ``*.py`` file as (POSIX path relative to ``root``, absolute path), sorted by the
    relative path so the document order is the same everywhere."""
    root = stdlib_root() if root is None else Path(root)
    files = []
    # os.walk, pruned: site-packages (a large installed environment) is never even listed.
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        for name in names:
            if name.endswith(".py") and not name.startswith(_EXCLUDED_PREFIXES):
                path = Path(directory, name)
                files.append((path.relative_to(root).as_posix(), path))
    files.sort(key=lambda item: item[0])
    return files


def held_out_key(key: str, fraction: float) -> bool:
    """Whether the document named ``key`` belongs to the held-out split (a 64-bit BLAKE2b hash of
    the key, read as a number in [0, 1), below ``fraction``)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / _HASH_SCALE < fraction


def held_out_indices(num_documents: int, fraction: float, salt: int = 0) -> np.ndarray:
    """(num_documents,) bool: the held-out mask for documents identified only by their index
    (prepared ArrayRecord data), from a vectorised splitmix64 hash of (index, salt)."""
    with np.errstate(over="ignore"):
        x = np.arange(num_documents, dtype=np.uint64) + np.uint64(salt) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def read_stdlib(root: Path | None = None) -> tuple[list[str], list[str], list[str]]:
    """Read the stdlib corpus: (keys, texts, skipped keys).

    Files that are not strict UTF-8 (a few test files are deliberately Latin-1 or KOI8-R) or cannot
    be read are skipped regardless of ``data.on_bad_document``: the corpus is ours, not the user's,
    so there is nothing the user could fix.
    """
    keys, texts, skipped = [], [], []
    for key, path in stdlib_files(root):
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            skipped.append(key)
            continue
        keys.append(key)
        texts.append(text)
    return keys, texts, skipped
