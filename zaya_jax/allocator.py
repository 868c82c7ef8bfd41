"""The host memory allocator of ``zaya`` processes: mimalloc from its wheel, or tcmalloc.

Why: XLA:CPU allocates each execution's temporary buffer afresh (277 MB for the ``tiny`` train step
at 16 × 128 tokens) from a PjRt worker thread. glibc's malloc serves a block that size from a fresh
``mmap`` every time (a thread arena holds at most 64 MB, and the mmap threshold is capped at 32 MB),
so every step faults in and zeroes each page of it and unmaps it again: ~71,000 page faults and
~150 ms of kernel time per ``tiny`` step on 2 cores, about a third of the step. XLA offers no host
allocator option, and an allocator cannot be swapped once a process runs, so the ``zaya`` command
re-executes itself once with an allocator in ``LD_PRELOAD`` (the same process id: Slurm,
Kubernetes and ``zaya supervise`` see no difference) before it imports JAX.

Which one (``bench/train_vs_hf.py --allocators``, ``bench/RESULTS.md``): mimalloc, from the ``cmeel-mimalloc``
wheel that ``pip install`` brings on Linux x86-64 and aarch64, with ``MIMALLOC_PURGE_DELAY=-1``: it
then keeps freed memory mapped for reuse, and a step faults nothing in afresh (and
``MIMALLOC_ALLOW_THP=0``, see :data:`OPTIONS`). With its default
purge delay (10 ms) it hands a step's buffer back between steps and the kernel zeroes it again
(few faults, as it maps huge pages, but as much kernel time as glibc). tcmalloc (gperftools) keeps
freed spans too, but comes only from the system's packages. glibc's own settings do not help:
``MALLOC_MMAP_MAX_=0`` with a high trim threshold still faulted (49,000 per execution of a 128 MiB
program); with ``MALLOC_ARENA_MAX=1`` as well it stopped faulting but serialised every thread on
one arena. jemalloc 5.3 with its defaults kept faulting (71,700 per step).

``ZAYA_ALLOCATOR`` chooses: ``auto`` (the default: mimalloc from the wheel, else tcmalloc where
installed, else the system's malloc), ``mimalloc``, ``tcmalloc``, ``system`` (never re-execute),
or the path of an allocator library to preload. Options a user sets in the environment
(``MIMALLOC_PURGE_DELAY``, ...) win over the ones set here. Python code that imports ``zaya_jax``
(notebooks, tests) keeps the allocator it was started with: start it as
``env $(python -m zaya_jax.allocator --env) python ...`` (the library and its options) for the same
effect, or ``LD_PRELOAD=$(python -m zaya_jax.allocator)`` for the library alone.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import os
import sys
from pathlib import Path

ENV = "ZAYA_ALLOCATOR"
_REEXECUTED = "ZAYA_ALLOCATOR_REEXECUTED"  # set in the re-executed process: never loop
_NAMES = ("tcmalloc_minimal", "tcmalloc")
KINDS = ("mimalloc", "tcmalloc", "jemalloc")
# Each allocator's settings, unless the environment sets them: mimalloc keeps freed memory mapped
# (its default purges it after 10 ms, and the next step faults it in again) and asks for no
# transparent huge pages (with them, where the kernel defragments on madvise, the default, a tiny
# step spent 2-810 ms in the kernel compacting memory, varying run to run; without, 5-25 ms, and
# 10-30% less peak memory); gperftools reports every allocation over 1 GiB on stderr, and a large
# model's host arrays are.
OPTIONS = {
    "mimalloc": {"MIMALLOC_PURGE_DELAY": "-1", "MIMALLOC_ALLOW_THP": "0"},
    "tcmalloc": {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)},
}


class AllocatorError(ValueError):
    """``ZAYA_ALLOCATOR`` names something that cannot be used."""


def find_tcmalloc() -> str | None:
    """An installed tcmalloc library (Debian/Ubuntu ``libtcmalloc-minimal4``, Fedora/RHEL
    ``gperftools-libs``, or conda's in ``$CONDA_PREFIX/lib``), or None. The loader's cache gives a
    bare soname, which ``LD_PRELOAD`` accepts."""
    conda = Path(os.environ.get("CONDA_PREFIX", "/nonexistent")) / "lib" / "libtcmalloc_minimal.so.4"
    if conda.is_file():
        return str(conda)
    return next(filter(None, map(ctypes.util.find_library, _NAMES)), None)


def find_mimalloc() -> str | None:
    """mimalloc from the ``cmeel-mimalloc`` wheel (a dependency of zaya-jax on Linux), or None."""
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "libmimalloc.so" and file.parent.name == "lib":
            path = Path(str(file.locate())).resolve()
            if path.is_file():
                return str(path)
    return None


def kind(library: str) -> str | None:
    """Which allocator a library path is (one of :data:`KINDS`), by its name; None if unknown."""
    name = os.path.basename(library)
    return next((k for k in KINDS if k in name), None)


def loaded_allocator() -> str | None:
    """The preloaded allocator library this process runs with (mimalloc, tcmalloc or jemalloc), or
    None for the C library's malloc; read from the process's memory map."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if path.startswith("/") and kind(path):
            return path
    return None


def wanted_library() -> str | None:
    """The library ``ZAYA_ALLOCATOR`` asks for (None: the system's malloc). A name that is not
    installed, or a path that is not a file, is an :class:`AllocatorError`."""
    choice = os.environ.get(ENV, "auto").strip() or "auto"
    if choice == "system":
        return None
    if choice == "auto":
        return find_mimalloc() or find_tcmalloc()
    if choice in ("mimalloc", "tcmalloc"):
        found = find_mimalloc() if choice == "mimalloc" else find_tcmalloc()
        if found is None:
            fix = (
                "pip install cmeel-mimalloc"
                if choice == "mimalloc"
                else "apt-get install libtcmalloc-minimal4 or dnf install gperftools-libs"
            )
            raise AllocatorError(f"{ENV}={choice}: {choice} is not installed; {fix}, or set {ENV}=auto")
        return found
    if not Path(choice).is_file():
        raise AllocatorError(
            f"{ENV}={choice!r}: no such file; set it to auto, mimalloc, tcmalloc, system or the path "
            "of an allocator library (e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4)"
        )
    return choice


def allocator_env(env: dict[str, str], library: str) -> dict[str, str]:
    """A copy of ``env`` that runs a process under ``library``: it first in ``LD_PRELOAD``, and its
    :data:`OPTIONS` where ``env`` does not set them."""
    return {**OPTIONS.get(kind(library) or "", {}), **with_preload(env, library)}


def with_preload(env: dict[str, str], library: str) -> dict[str, str]:
    """A copy of the environment ``env`` with ``library`` first in ``LD_PRELOAD``."""
    return {**env, "LD_PRELOAD": " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)}


def reexec_with_allocator() -> None:
    """Replace this process with the same command under the allocator ``ZAYA_ALLOCATOR`` asks for,
    unless it already runs under one, the choice is the system's malloc, or this process is the
    re-executed one. Call before JAX is imported; returns only when nothing is to be done."""
    if not sys.platform.startswith("linux") or os.environ.get(_REEXECUTED) or loaded_allocator():
        return
    library = wanted_library()
    if library is None:
        return
    env = {**allocator_env(dict(os.environ), library), _REEXECUTED: library}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


SLOW = (
    "the system's malloc: each CPU step faults its temporary buffers in afresh "
    "(1.4-1.8x slower tiny train steps)"
)
_COMMAND = [False]  # set by the zaya command (zaya_jax.cli.entry): it, not the Python API, warns


def mark_command() -> None:
    """Record that this process is the ``zaya`` command, whose ``train`` prints
    :func:`slow_path_warning` (the Python API and the tests that drive it in-process do not)."""
    _COMMAND[0] = True


def is_command() -> bool:
    """Whether :func:`mark_command` was called in this process."""
    return _COMMAND[0]


FIX = "pip install cmeel-mimalloc (or apt-get install libtcmalloc-minimal4), then run zaya again"


def describe() -> str:
    """One line for ``zaya doctor``: the allocator this process runs with, and what to do if it is
    the system's malloc."""
    active = loaded_allocator()
    if active:
        return active
    if os.environ.get(ENV, "auto") == "system":
        return f"system malloc ({ENV}=system)"
    library = find_mimalloc() or find_tcmalloc()
    if library:
        return f"system malloc (in this process; the zaya command runs under {library})"
    return f"{SLOW}; {FIX}"


def slow_path_warning() -> str | None:
    """The one line ``zaya train`` prints when its CPU steps run on the slow path (the system's
    malloc), naming the cost and the fix; None when an allocator that keeps freed memory runs."""
    if not sys.platform.startswith("linux") or loaded_allocator():
        return None
    if os.environ.get(ENV, "auto") == "system":
        return f"zaya: CPU steps run under {SLOW} ({ENV}=system); unset {ENV} to run under mimalloc"
    library = find_mimalloc() or find_tcmalloc()
    if library:  # a Python process (a notebook, a script) that was not started under it
        return (
            f"zaya: CPU steps run under {SLOW}; start Python as "
            f"env $(python -m zaya_jax.allocator --env) python ... (or use the zaya command)"
        )
    return f"zaya: CPU steps run under {SLOW}; {FIX}"


if __name__ == "__main__":  # the library to put in LD_PRELOAD (--env: with its options), for notebooks
    found = wanted_library()
    if found and sys.argv[1:] == ["--env"]:
        options = allocator_env({}, found)
        print(" ".join(f"{k}={os.environ.get(k, v) if k != 'LD_PRELOAD' else v}" for k, v in options.items()))
    elif found:
        print(found)
    sys.exit(0 if found else 1)
