"""Which step of a run can be read: the structural check of a step directory (before any array is
read) and the walk from the latest step back past the damaged ones, shared by everything that loads
a checkpoint (training's resume, ``zaya eval``/``generate``/``inspect``/``convert``,
``zaya_jax.load``, ``train.init_from``, the lm-eval model).

A step is *damaged* when its directory, its ``_CHECKPOINT_METADATA`` or an item it needs is
missing, empty or unreadable, when Orbax or TensorStore cannot read it, or when an array reads back
different from its fingerprint. On a run directory a damaged step is set aside (moved to
``<run>/quarantine/<step>-<time>``, never deleted; left in place with a warning where the run is
read-only) with one line saying so, and the previous step is tried; given a step directory, a
damaged step is a :class:`CheckpointCorruptError` naming the step, what is wrong and the fix; with
no readable step left, a :class:`CheckpointNotFoundError` lists each step and why.

Not damage: a permission denied (another user's files: :class:`PermissionError` as it is), and a
config item that parses but does not fit this version's schema (a :class:`ConfigError` naming the
file: the checkpoint may be fine and the code newer), so a change in zaya-jax never moves a
user's checkpoint aside.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from zaya_jax.checkpoint.store import (
    CHECKPOINTS,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    manager,
    set_aside,
)
from zaya_jax.config import ConfigError

T = TypeVar("T")
JSON_ITEMS = {
    "config": "metadata",
    "fingerprints": "metadata",
}  # item -> the file JsonCheckpointHandler writes
STEP_METADATA = "_CHECKPOINT_METADATA"


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def _json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} ({what}) is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointCorruptError(f"{path} ({what}) is not valid JSON ({one_line(err)})") from None
    except IsADirectoryError:
        raise CheckpointCorruptError(f"{path} ({what}) is a directory, not a file") from None


def saved_items(step_dir: Path) -> set[str]:
    """The items Orbax recorded for a step (its ``_CHECKPOINT_METADATA``)."""
    meta = _json(step_dir / STEP_METADATA, "Orbax's record of the step")
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    if not isinstance(handlers, dict):
        raise CheckpointCorruptError(f"{step_dir / STEP_METADATA} does not list the step's items")
    return set(handlers)


def check_step(step_dir: Path, needed: Iterable[str]) -> set[str]:
    """Raise :class:`CheckpointCorruptError` naming what is missing or unreadable in ``step_dir``
    among the ``needed`` items (and the fingerprints, when the step has them), from the step's
    structure and metadata alone; returns the items the step holds."""
    if not step_dir.is_dir():
        state = "a broken link" if step_dir.is_symlink() else "not a directory"
        raise CheckpointCorruptError(f"{step_dir} is {state}")
    items = saved_items(step_dir)
    wanted = [*needed, *(["fingerprints"] if "fingerprints" in items else [])]
    for name in wanted:
        item = step_dir / name
        if name not in items:
            raise CheckpointCorruptError(f"{step_dir} was saved without its {name} item")
        if not item.is_dir():
            raise CheckpointCorruptError(f"{item} (the {name} item) is missing")
        if name in JSON_ITEMS:
            if not isinstance(_json(item / JSON_ITEMS[name], f"the {name} item"), dict):
                raise CheckpointCorruptError(
                    f"{item / JSON_ITEMS[name]} (the {name} item) is not a JSON object"
                )
            continue
        meta = _json(item / "_METADATA", f"the {name} item's array metadata")
        if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
            raise CheckpointCorruptError(f"{item / '_METADATA'} does not describe the {name} arrays")
    return items


def locate(path: str | Path) -> tuple[Path, int | None]:
    """(checkpoints dir, the step a step directory names; None for a run directory)."""
    path = Path(path)
    if path.parent.name == CHECKPOINTS and path.name.isdigit():
        if not path.exists() and not path.is_symlink():
            raise CheckpointNotFoundError(f"{path} does not exist")
        return path.parent, int(path.name)
    if (path / CHECKPOINTS).is_dir():
        return path / CHECKPOINTS, None
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if (path / "config.yaml").is_file():
        raise CheckpointNotFoundError(
            f"{path / CHECKPOINTS} is missing: {path} is a run directory (it has config.yaml) without checkpoints; "
            "restore them from a copy, or give another run"
        )
    raise CheckpointNotFoundError(
        f"{path} is neither a run directory (with {CHECKPOINTS}/) nor a step directory ({CHECKPOINTS}/<step>)"
    )


def first_readable(path: str | Path, read: Callable[[Path, int], T], needed: Iterable[str]) -> tuple[T, int]:
    """(``read(checkpoints, step)``, step) for the latest readable step of a run directory, setting
    damaged ones aside, or for the step directory ``path`` names (raising if it is damaged).
    ``read`` is called after :func:`check_step` passed for ``needed``; any error it raises other than
    a permission or config-schema error marks the step damaged."""
    checkpoints, step = locate(path)
    needed = tuple(needed)
    quiet_orbax_leftovers()  # before reading: a failed read's leftovers report while it fails
    if step is not None:
        try:
            return _read_step(checkpoints, step, read, needed), step
        except CheckpointCorruptError as err:
            run = checkpoints.parent
            raise CheckpointCorruptError(
                f"checkpoint step {step} cannot be used: {err}. Give the run directory {run} to use its latest "
                "readable step, or restore this step's files from a copy"
            ) from err
    steps = sorted(manager(checkpoints).all_steps(), reverse=True)
    skipped = []
    for step in steps:
        try:
            return _read_step(checkpoints, step, read, needed), step
        except CheckpointCorruptError as err:
            skipped.append(f"step {step}: {one_line(err)[:300]}")
            set_aside(checkpoints, step, err)
    if not skipped:
        raise CheckpointNotFoundError(f"{checkpoints} holds no complete checkpoint")
    raise CheckpointNotFoundError(
        f"{checkpoints} holds no readable checkpoint ({'; '.join(skipped)}); the damaged steps were moved to "
        f"{checkpoints.parent / 'quarantine'}: restore a copy of one, or train again"
    )


def _read_step(checkpoints: Path, step: int, read: Callable[[Path, int], T], needed: tuple[str, ...]) -> T:
    step_dir = checkpoints / str(step)
    check_step(step_dir, needed)
    try:
        return read(checkpoints, step)
    except (CheckpointCorruptError, PermissionError, ConfigError):
        raise
    except Exception as err:  # Orbax and TensorStore raise many types for unreadable files
        text = one_line(err)
        arrays = sorted(set(re.findall(r"'path': '([\w.]+)/'", text)))  # TensorStore names the array it read
        where = f" reading {', '.join(arrays[:4])}" if arrays else ""
        reason = text.split(" See full TensorStore details")[0][:400]
        raise CheckpointCorruptError(
            f"{step_dir} cannot be read ({type(err).__name__}{where}: {reason})"
        ) from None


def quiet_orbax_leftovers() -> None:
    """A failed Orbax read leaves its other reads behind: coroutines that, when collected (at exit,
    after the one-line message), Python would report with a traceback each (hundreds of lines of
    TensorStore specs), and TensorStore callbacks that find Orbax's event loop closed. Silence
    exactly those, nothing else."""
    if getattr(sys.unraisablehook, "_zaya_quiet_orbax", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        code = getattr(unraisable.object, "cr_code", None)
        if code is not None and "orbax" in code.co_filename:
            return
        if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
            return  # a TensorStore read finishing after Orbax closed its event loop
        previous(unraisable)

    hook._zaya_quiet_orbax = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
