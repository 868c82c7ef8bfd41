"""The argv dialects ``zaya`` accepts beside argparse's own: options after positionals
(``zaya train k=v --no-progress``), Levanter's ``--train.steps 10``, a positional config
(``zaya train small k=v``, MaxText's shape) and ``zaya inspect``'s path-or-config positional."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from zaya_jax.config import ConfigError, available_presets

# Subcommands whose options may come after their positional arguments (``zaya train k=v --no-progress
# k2=v2``): parsed with argparse's intermixed parsing. ``supervise`` passes its tail on untouched.
_INTERMIXED = ("train", "eval", "generate", "inspect", "convert")


def _config_section_flags(tokens: list[str]) -> list[str]:
    """``--train.steps 10`` / ``--train.steps=10`` (Levanter's shape) -> ``train.steps=10``."""
    from zaya_jax.config import Config

    sections = {f.name for f in dataclasses.fields(Config)}
    out, i = [], 0
    while i < len(tokens):
        token = tokens[i]
        name = token[2:].partition("=")[0]
        if token.startswith("--") and "." in name and name.split(".")[0] in sections:
            if "=" in token:
                out.append(token[2:])
            elif i + 1 < len(tokens):
                out.append(f"{name}={tokens[i + 1]}")
                i += 1
            else:
                raise ConfigError(f"{token} needs a value: {token} VALUE or {name}=VALUE")
        else:
            out.append(token)
        i += 1
    return out


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = next((t for t in argv if not t.startswith("-")), None)
    if command not in _INTERMIXED:
        return parser.parse_args(argv)
    index = argv.index(command)
    if index:  # top-level options before the subcommand (--version, --help)
        parser.parse_args(argv[:index])
    args = subparsers.choices[command].parse_intermixed_args(_config_section_flags(argv[index + 1 :]))
    args.subcommand = command
    return args


def positional_config(args: argparse.Namespace) -> None:
    """``zaya train my.yaml k=v`` / ``zaya train small k=v`` (MaxText's shape): a first positional
    that is a preset name or a YAML file is the config."""
    if args.subcommand != "train" or not args.overrides:
        return
    first = args.overrides[0]
    if "=" in first:
        return
    if first in available_presets() or first.endswith((".yaml", ".yml")):
        if args.config not in (None, "tiny") and args.config != first:
            raise ConfigError(f"two configs given: --config {args.config} and {first}; give one")
        args.config, args.overrides = first, args.overrides[1:]


def inspect_positionals(args: argparse.Namespace) -> None:
    """``zaya inspect`` takes a path, or a config and overrides: a first positional that is not an
    existing path is a preset/YAML (``zaya inspect small``) or an override (``model.num_layers=4``)."""
    if not args.path or Path(args.path).exists():
        return
    if args.path in available_presets() or args.path.endswith((".yaml", ".yml")):
        if args.config is not None:
            raise ConfigError(f"two configs given: --config {args.config} and {args.path}; give one")
        args.config, args.path = args.path, None
    elif "=" in args.path or ("." in args.path and "/" not in args.path):
        args.overrides, args.path = [args.path, *args.overrides], None
        args.config = args.config or "tiny"


def command_name(argv: list[str]) -> str:
    """The subcommand, for error messages (``data prepare``: both words)."""
    words = [t for t in argv if not t.startswith("-")]
    if not words:
        return ""
    return " ".join(words[:2]) if words[0] == "data" and len(words) > 1 else words[0]
