"""The ``zaya`` command line. ``zaya`` and ``python -m zaya_jax.cli`` start in :func:`entry`, which
first re-executes the process under mimalloc or tcmalloc (``zaya_jax.allocator``) and only then imports JAX
and the commands (``zaya_jax.cli.commands``); ``main(argv)`` runs one command in this process (the
tests and the Python API), and loads the commands on first use."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["build_parser", "entry", "main"]


def entry() -> int:
    """The ``zaya`` script: the command line in ``sys.argv``, under the preferred allocator."""
    from zaya_jax.allocator import AllocatorError, mark_command, reexec_with_allocator

    try:
        reexec_with_allocator()
    except AllocatorError as err:
        print(f"zaya: {err}", file=sys.stderr)
        return 2
    mark_command()  # `zaya train` says so when its CPU steps run on the slow allocator path
    from zaya_jax.cli.commands import main as run

    return run()


def __getattr__(name: str) -> Any:  # main and build_parser, loaded on first use
    if name in ("main", "build_parser"):
        from zaya_jax.cli import commands

        return getattr(commands, name)
    raise AttributeError(f"module 'zaya_jax.cli' has no attribute {name!r}")
