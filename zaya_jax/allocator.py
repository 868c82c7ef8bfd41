"""The host memory allocator of ``zaya`` processes: tcmalloc where it is installed.

Why: XLA:CPU allocates each execution's temporary buffer afresh (277 MB for the ``tiny`` train step
at 16 × 128 tokens) from a PjRt worker thread. glibc's malloc serves a block that size from a fresh
``mmap`` every time (a thread arena holds at most 64 MB, and the mmap threshold is capped at 32 MB),
so every step faults in and zeroes each page of it and unmaps it again: ~71,000 page faults and
~150 ms of kernel time per ``tiny`` step on 2 cores, about a third of the step. tcmalloc (gperftools)
keeps freed spans for reuse: 11 faults per step and a 1.5-1.8× faster step (bench/RESULTS.md).
XLA offers no host allocator option, and an allocator cannot be swapped once a process runs, so
the ``zaya`` command re-executes itself once with tcmalloc in ``LD_PRELOAD`` (the same process id:
Slurm, Kubernetes and ``zaya supervise`` see no difference) before it imports JAX. It is the route
PyTorch's and TensorFlow's CPU performance guides document; there is no pip-installable tcmalloc.

``ZAYA_ALLOCATOR`` chooses: ``auto`` (the default: tcmalloc when a library is found, else the
system's malloc), ``system`` (never re-execute), or the path of an allocator library to preload.
Python code that imports ``zaya_jax`` (notebooks, tests) keeps the allocator it was started with:
start it as ``LD_PRELOAD=$(python -m zaya_jax.allocator) python ...`` for the same effect.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ENV = "ZAYA_ALLOCATOR"
_REEXECUTED = "ZAYA_ALLOCATOR_REEXECUTED"  # set in the re-executed process: never loop
_NAMES = ("tcmalloc_minimal", "tcmalloc")
# gperftools reports every allocation over 1 GiB on stderr; a large model's host arrays are.
_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)}


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


def loaded_allocator() -> str | None:
    """The preloaded allocator library this process runs with (tcmalloc or jemalloc), or None for
    the C library's malloc; read from the process's memory map."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if ("tcmalloc" in path or "jemalloc" in path) and path.startswith("/"):
            return path
    return None


def wanted_library() -> str | None:
    """The library ``ZAYA_ALLOCATOR`` asks for (None: the system's malloc). A path that is not a
    file is an :class:`AllocatorError`."""
    choice = os.environ.get(ENV, "auto").strip() or "auto"
    if choice == "system":
        return None
    if choice == "auto":
        return find_tcmalloc()
    if not Path(choice).is_file():
        raise AllocatorError(
            f"{ENV}={choice!r}: no such file; set it to auto, system or the path of an allocator "
            "library (e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4)"
        )
    return choice


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
    env = {**_QUIET, **with_preload(dict(os.environ), library), _REEXECUTED: library}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe() -> str:
    """One line for ``zaya doctor``: the allocator this process runs with, and what to do if it is
    the system's malloc."""
    active = loaded_allocator()
    if active:
        return active
    library = find_tcmalloc()
    if os.environ.get(ENV, "auto") == "system":
        return f"system malloc ({ENV}=system)"
    if library:
        return f"system malloc (in this process; the zaya command runs under {library})"
    return (
        "system malloc: CPU train steps run up to 1.8x slower, faulting in their buffers afresh; "
        "install tcmalloc (apt-get install libtcmalloc-minimal4, dnf install gperftools-libs)"
    )


if __name__ == "__main__":  # the library to put in LD_PRELOAD, for notebooks and scripts
    found = wanted_library()
    if found:
        print(found)
    sys.exit(0 if found else 1)
