"""What every checkpoint shares: the Orbax manager and its item handlers, retention policies, the
errors, array fingerprints checked on restore, and quarantine (a step set aside, never deleted)."""

from __future__ import annotations

import json
import logging
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


def _per_process_handlers() -> dict[str, ocp.CheckpointHandler]:
    """The items of :func:`_handlers`, each process writing and reading only its own part, alone:
    every process is the primary of its own directory (``primary_host=None``) and the only process
    Orbax synchronises with (``active_processes``: no barrier with another process), and its arrays
    are saved one copy of each shard it holds (``replica_id=None``: a replicated array's too, where
    the default saves replica 0's, held by one process). Orbax's own setup for local storage
    (``orbax/checkpoint/experimental/emergency/p2p/local.py``), without its barriers."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _NoSizeLogNotice) for f in absl.filters):
        absl.addFilter(_NoSizeLogNotice())
    options = _alone()
    shards = ocp.type_handlers.create_type_handler_registry(
        (
            jax.Array,
            ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False),
        )
    )

    def arrays() -> ocp.CheckpointHandler:
        return ocp.PyTreeCheckpointHandler(multiprocessing_options=options, type_handler_registry=shards)

    def record(**kwargs: Any) -> ocp.CheckpointHandler:
        return ocp.JsonCheckpointHandler(multiprocessing_options=options, **kwargs)

    handlers = {name: record() for name in ("base", "config", "fingerprints")}
    handlers |= {name: arrays() for name in ("params", "balancing", "train", "ahead")}
    return handlers | {"data": record(filename=data_filename())}


class _NoSizeLogNotice(logging.Filter):
    """Orbax warns at every save with ``primary_host=None`` that it does not log sizes: a local
    tier would print it at every local save."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Global object size logging disabled")


def _alone() -> ocp.options.MultiprocessingOptions:
    """Orbax's options for a process saving and reading its own directory, synchronised with no other."""
    process = jax.process_index()
    return ocp.options.MultiprocessingOptions(
        primary_host=None, active_processes={process}, barrier_sync_key_prefix=f"zaya_local_{process}"
    )


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
    per_process: bool = False,
) -> ocp.CheckpointManager:
    """An Orbax manager over ``checkpoints_dir`` keeping the ``keep`` latest steps (None: all), every
    ``keep_every``-th step and the ``keep_best`` steps of lowest saved ``eval_loss``; only committed
    (complete) steps are listed. ``per_process``: this process's own directory of a local tier
    (:mod:`zaya_jax.checkpoint.local`), holding its shards only. The unfinished saves a killed
    process leaves there (``<step>.orbax-checkpoint-tmp``) are not listed, and not removed."""
    keeping: list[policies.PreservationPolicy] = [policies.LatestN(n=keep)]
    if keep_every:
        keeping.append(policies.EveryNSteps(interval_steps=keep_every))
    if keep_best:  # BestN keeps the last n after sorting: descending, so the lowest losses
        keeping.append(
            policies.BestN(
                get_metric_fn=_eval_loss, reverse=True, n=keep_best, keep_checkpoints_without_metrics=False
            )
        )
    directory = Path(checkpoints_dir).absolute()
    handlers, alone = _handlers, {}
    if per_process:  # Orbax creates a directory on process 0 only; each process makes its own
        directory.mkdir(parents=True, exist_ok=True)
        handlers, alone = (
            _per_process_handlers,
            {"multiprocessing_options": _alone()},
        )
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=async_save,
        create=not per_process,
        preservation_policy=policies.AnyPreservationPolicy(keeping),
        best_fn=_eval_loss if keep_best else None,  # makes Orbax record the metrics of each step
        best_mode="min",
        **alone,
    )
    try:
        return ocp.CheckpointManager(directory, options=options, item_handlers=handlers())
    except (ValueError, TypeError, KeyError) as err:  # Orbax reads every step's record at start
        damaged = damaged_step_records(directory)
        if not damaged:
            raise
        for step, reason in damaged:
            set_aside(directory, step, CheckpointCorruptError(reason), own=per_process)
        try:
            return ocp.CheckpointManager(directory, options=options, item_handlers=handlers())
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


def quarantine(checkpoints_dir: str | Path, step: int, own: bool = False) -> Path:
    """Move an unreadable checkpoint out of the checkpoints directory (never delete it) to
    ``<run>/quarantine/<step>-<time>``, so a later save of the same step has room. Process 0 moves
    a shared directory's step; ``own``: this process's own directory (a local tier's), moved here."""
    source = Path(checkpoints_dir) / str(step)
    target = Path(checkpoints_dir).parent / QUARANTINE / f"{step}-{int(time.time())}"
    if (own or jax.process_index() == 0) and os.path.lexists(source):
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
    return target


def set_aside(checkpoints_dir: str | Path, step: int, err: Exception, own: bool = False) -> dict[str, Any]:
    """Quarantine an unreadable or corrupt step, with a one-line warning; its ``checkpoint_unreadable``
    detail. Where it cannot be moved (a read-only run), it is left in place and skipped."""
    reason = " ".join(f"{type(err).__name__}: {err}".split())
    try:
        moved: str | None = str(quarantine(checkpoints_dir, step, own))
        where = f"moved to {moved}"
    except OSError as move_err:
        moved, where = None, f"left in place (it cannot be moved: {' '.join(str(move_err).split())})"
    warnings.warn(
        f"checkpoint step {step} in {checkpoints_dir} cannot be used ({reason[:600]}); {where}, trying the "
        "previous one",
        stacklevel=3,
    )
    return {"checkpoint": step, "error": reason[:1000], "moved_to": moved}
