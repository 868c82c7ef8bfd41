"""What every checkpoint shares: the Orbax manager and its item handlers, retention policies, the
errors, array fingerprints checked on restore, and quarantine (a step set aside, never deleted)."""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from zaya_jax.checkpoint.fingerprint import fingerprints, mismatches, stored_in

MODEL_ITEMS = ("params", "balancing")
CHECKPOINTS = "checkpoints"


class CheckpointNotFoundError(FileNotFoundError):
    """No complete checkpoint where one was expected; the message says where it looked."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint that cannot be used: an item missing, empty or unreadable, or an array that reads
    back different from what was saved (bytes changed on disk); the message names the files."""


class BaseMismatchError(ValueError):
    """A LoRA checkpoint whose recorded base model is not the one given: its adapters would run on
    other weights. Never a reason to set the checkpoint aside (it is intact)."""


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    return {
        # A LoRA run's step: the base model its adapters belong to (zaya_jax.checkpoint.base).
        "base": ocp.JsonCheckpointHandler(),
        "params": ocp.StandardCheckpointHandler(),
        "balancing": ocp.StandardCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
        "fingerprints": ocp.JsonCheckpointHandler(),
        "train": ocp.StandardCheckpointHandler(),
        # GRPO's rollouts sampled ahead (rl.max_staleness): the weights each is sampled from.
        "ahead": ocp.StandardCheckpointHandler(),
        # Every process saves and restores its own data position (its share of the rows).
        "data": ocp.JsonCheckpointHandler(
            filename=data_filename(),
            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None),
        ),
    }


def data_filename(process_index: int | None = None, process_count: int | None = None) -> str:
    """The data position file of a process (this one by default) in a step's ``data/``."""
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    return f"process_{index}-of-{count}.json"


def manager(
    checkpoints_dir: str | Path,
    *,
    async_save: bool = False,
    keep: int | None = None,
    keep_every: int = 0,
    keep_best: int = 0,
) -> ocp.CheckpointManager:
    """An Orbax manager over ``checkpoints_dir`` keeping the ``keep`` latest steps (None: all), every
    ``keep_every``-th step and the ``keep_best`` steps of lowest saved ``eval_loss``; only committed
    (complete) steps are listed."""
    keeping: list[policies.PreservationPolicy] = [policies.LatestN(n=keep)]
    if keep_every:
        keeping.append(policies.EveryNSteps(interval_steps=keep_every))
    if keep_best:  # BestN keeps the last n after sorting: descending, so the lowest losses
        keeping.append(
            policies.BestN(
                get_metric_fn=_eval_loss, reverse=True, n=keep_best, keep_checkpoints_without_metrics=False
            )
        )
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=async_save,
        create=True,
        preservation_policy=policies.AnyPreservationPolicy(keeping),
        best_fn=_eval_loss if keep_best else None,  # makes Orbax record the metrics of each step
        best_mode="min",
    )
    directory = Path(checkpoints_dir).absolute()
    try:
        return ocp.CheckpointManager(directory, options=options, item_handlers=_handlers())
    except (ValueError, TypeError, KeyError) as err:  # Orbax reads every step's record at start
        damaged = damaged_step_records(directory)
        if not damaged:
            raise
        for step, reason in damaged:
            set_aside(directory, step, CheckpointCorruptError(reason))
        try:
            return ocp.CheckpointManager(directory, options=options, item_handlers=_handlers())
        except (ValueError, TypeError, KeyError):
            listed = "; ".join(reason for _, reason in damaged)
            raise CheckpointCorruptError(f"{listed}; move the step out of {directory} and rerun") from err


def damaged_step_records(checkpoints_dir: Path) -> list[tuple[int, str]]:
    """(step, why) for each step whose ``_CHECKPOINT_METADATA`` Orbax would refuse (it reads every
    step's record when a manager starts, so one damaged record stops them all)."""
    try:  # Orbax's own check of the record (internal: where it moves, a JSON check remains)
        from orbax.checkpoint._src.metadata.step_metadata_serialization import deserialize
    except ImportError:
        deserialize = dict
    found = []
    for path in sorted(p for p in checkpoints_dir.iterdir() if p.name.isdigit()):
        record = path / "_CHECKPOINT_METADATA"
        if not record.is_file():
            continue
        try:
            deserialize(json.loads(record.read_bytes()))
        except Exception as err:  # JSON, UTF-8 and Orbax's own type checks
            found.append((int(path.name), f"{record} is damaged ({' '.join(str(err).split())[:200]})"))
    return found


def _eval_loss(metrics: dict[str, Any]) -> float:
    return float(metrics["eval_loss"])


def array_fingerprints(items: dict[str, Any]) -> dict[str, str]:
    return {k: v for name, tree in items.items() for k, v in fingerprints(tree, f"{name}/").items()}


def verify(step_dir: Path, saved: dict[str, str] | None, restored: dict[str, Any]) -> None:
    """Raise :class:`CheckpointCorruptError` naming every restored array whose fingerprint differs
    from the one recorded at save time (``saved`` None: a checkpoint written before fingerprints)."""
    if saved is None:
        return
    bad = mismatches(saved, array_fingerprints(restored))
    if bad:
        shown = [
            f"{name} (files: {', '.join(stored_in(step_dir, name)) or step_dir / name.split('/')[0]})"
            for name in bad[:8]
        ]
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise CheckpointCorruptError(
            f"{len(bad)} array(s) of {step_dir} read back different from what was saved: {'; '.join(shown)}{more}. "
            "The files changed on disk after the save (a storage fault or an interrupted copy)"
        )


def saved_fingerprints(mgr: ocp.CheckpointManager, step_dir: Path, step: int) -> dict[str, str] | None:
    if not (step_dir / "fingerprints").is_dir():
        return None
    return mgr.restore(step, args=ocp.args.Composite(fingerprints=ocp.args.JsonRestore()))["fingerprints"]


QUARANTINE = "quarantine"


def quarantine(checkpoints_dir: str | Path, step: int) -> Path:
    """Move an unreadable checkpoint out of the checkpoints directory (never delete it) to
    ``<run>/quarantine/<step>-<time>``, so a later save of the same step has room."""
    source = Path(checkpoints_dir) / str(step)
    target = Path(checkpoints_dir).parent / QUARANTINE / f"{step}-{int(time.time())}"
    if jax.process_index() == 0 and os.path.lexists(source):
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
    return target


def set_aside(checkpoints_dir: str | Path, step: int, err: Exception) -> dict[str, Any]:
    """Quarantine an unreadable or corrupt step, with a one-line warning; its ``checkpoint_unreadable``
    detail. Where it cannot be moved (a read-only run), it is left in place and skipped."""
    reason = " ".join(f"{type(err).__name__}: {err}".split())
    try:
        moved: str | None = str(quarantine(checkpoints_dir, step))
        where = f"moved to {moved}"
    except OSError as move_err:
        moved, where = None, f"left in place (it cannot be moved: {' '.join(str(move_err).split())})"
    warnings.warn(
        f"checkpoint step {step} in {checkpoints_dir} cannot be used ({reason[:600]}); {where}, trying the "
        "previous one",
        stacklevel=3,
    )
    return {"checkpoint": step, "error": reason[:1000], "moved_to": moved}
