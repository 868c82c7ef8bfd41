"""The ``zaya`` command line. ``zaya`` and ``python -m zaya_jax.cli`` start in :func:`entry`, which
first re-executes the process under tcmalloc (``zaya_jax.allocator``) and only then imports JAX
and the commands (``zaya_jax.cli.commands``); ``main(argv)`` runs one command in this process (the
tests and the Python API), and loads the commands on first use."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["build_parser", "entry", "main"]

_COMMANDS = {"main", "build_parser", "parse", "positional_config"}
_OLD_NAMES = {"_parse": "parse", "_positional_config": "positional_config"}  # kept for older imports


def entry() -> int:
    """The ``zaya`` script: the command line in ``sys.argv``, under the preferred allocator."""
    from zaya_jax.allocator import AllocatorError, reexec_with_allocator

    try:
        reexec_with_allocator()
    except AllocatorError as err:
        print(f"zaya: {err}", file=sys.stderr)
        return 2
    from zaya_jax.cli.commands import main as run

    return run()


def __getattr__(name: str) -> Any:
    if name in _COMMANDS or name in _OLD_NAMES:
        from zaya_jax.cli import commands

        value = getattr(commands, _OLD_NAMES.get(name, name))
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zaya_jax.cli' has no attribute {name!r}")
