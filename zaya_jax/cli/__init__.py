"""The ``zaya`` command line: one module per command group (``train``; ``evaluate``: eval and
generate; ``data``; ``convert``: convert and inspect; ``operations``: supervise and doctor), the argv
dialects in ``argv``; this module builds the parser and maps errors to exit codes (2: the input is
wrong; 1: the run failed or storage did)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from zaya_jax.checkpoint import CheckpointSaveError
from zaya_jax.cli import convert, data, evaluate, operations, train
from zaya_jax.cli.argv import command_name, inspect_positionals, parse, positional_config
from zaya_jax.config import ConfigError
from zaya_jax.files import storage_error_message
from zaya_jax.resilience import NonFiniteLossError, RoutingAlarmError

# Older names, kept for code that imported them from zaya_jax.cli.
_parse, _positional_config = parse, positional_config

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zaya", description="ZAYA1-style MoE language models in JAX.")
    parser.add_argument("--version", action="version", version=f"zaya-jax {_version()}")
    sub = parser.add_subparsers(dest="subcommand", required=True)
    for group in (train, evaluate, data, convert, operations):
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, hooks: Sequence[Any] = ()) -> int:
    """Run one ``zaya`` command; returns its exit code. ``hooks`` are passed to ``zaya train``'s
    loop (:class:`zaya_jax.train.hooks.Hook`; the tests' fault injection)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(parser, argv)
        args.hooks = tuple(hooks)
        if args.subcommand == "inspect":
            inspect_positionals(args)
        positional_config(args)
        return args.func(args)
    except ConfigError as err:
        print(f"zaya {command_name(argv)}: configuration error: {err}", file=sys.stderr)
        return 2
    except (CheckpointSaveError, NonFiniteLossError, RoutingAlarmError) as err:
        print(f"zaya {command_name(argv)}: {err}", file=sys.stderr)
        return 1
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"zaya {command_name(argv)}: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a read-only or forbidden directory
        print(f"zaya {command_name(argv)}: {storage_error_message(err)}", file=sys.stderr)
        return 1


def _version() -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version("zaya-jax")
    except metadata.PackageNotFoundError:
        return "unknown"
