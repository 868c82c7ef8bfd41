"""The ``zaya`` parser and its error handling: one module per command group (``train``;
``evaluate``: eval and generate; ``data``; ``convert``: convert and inspect; ``operations``:
supervise and doctor), the argv dialects in ``argv``; this module builds the parser and maps errors
to exit codes (2: the input is wrong; 1: the run failed or storage did)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TextIO

from zaya_jax.checkpoint import CheckpointCorruptError, CheckpointSaveError
from zaya_jax.cli import convert, data, evaluate, operations, train
from zaya_jax.cli.argv import command_name, inspect_positionals, parse, positional_config
from zaya_jax.config import ConfigError
from zaya_jax.files import storage_error_message
from zaya_jax.resilience import MetricBoundError, NonFiniteLossError, RoutingAlarmError
from zaya_jax.resilience.health import UnhealthyNodeError

if TYPE_CHECKING:
    from zaya_jax.train.hooks import Hook

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zaya", description="ZAYA1-style MoE language models in JAX.")
    parser.add_argument("--version", action="version", version=f"zaya-jax {_version()}")
    sub = parser.add_subparsers(dest="subcommand", required=True)
    for group in (train, evaluate, data, convert, operations):
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, hooks: Sequence[Hook] = ()) -> int:
    """Run one ``zaya`` command; returns its exit code. ``hooks`` are passed to ``zaya train``'s
    loop (:class:`zaya_jax.train.hooks.Hook`; the tests' fault injection)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning(command_name(argv))
        return _run(parser, argv, hooks)


def _one_line_warning(command: str) -> Callable[..., None]:
    """Warnings (a checkpoint set aside, a fallback taken) as one ``zaya CMD: warning:`` line each."""

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = " ".join(str(message).split())
        print(f"zaya {command}: warning: {text}", file=file or sys.stderr, flush=True)

    return show


def _run(parser: argparse.ArgumentParser, argv: list[str], hooks: Sequence[Hook]) -> int:
    try:
        args = parse(parser, argv)
        args.hooks = tuple(hooks)
        if args.subcommand == "inspect":
            inspect_positionals(args)
        positional_config(args)
        return args.func(args)
    except ConfigError as err:
        return _error(argv, f"configuration error: {err}", 2)
    except UnhealthyNodeError as err:  # 76: drained, restart without the node; 77: stopped
        return _error(argv, err, err.exit_code)
    except (
        CheckpointCorruptError,
        CheckpointSaveError,
        MetricBoundError,
        NonFiniteLossError,
        RoutingAlarmError,
    ) as err:
        return _error(argv, err, 1)
    except RuntimeError as err:  # out of memory, planned or at run time: one line with advice
        from zaya_jax.train.fit import OutOfMemoryError, is_out_of_memory, out_of_memory_message

        if isinstance(err, OutOfMemoryError):
            return _error(argv, err, 1)
        if is_out_of_memory(err):
            return _error(argv, out_of_memory_message(err), 1)
        raise
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        return _error(argv, err, 2)
    except OSError as err:  # a full disk, a read-only or forbidden directory
        return _error(argv, storage_error_message(err), 1)


def _error(argv: list[str], message: object, code: int) -> int:
    """The command's error as one line on stderr; returns its exit code."""
    print(f"zaya {command_name(argv)}: {' '.join(str(message).split())}", file=sys.stderr)
    return code


def _version() -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version("zaya-jax")
    except metadata.PackageNotFoundError:
        return "unknown"
