"""Training checkpoints: the whole train state and the data position of every process, saved
(async, never failing silently) and restored into the current layout's shardings, the latest
readable step first.

An async save commits (step metadata, OCDBT merge, rename of ``<step>.orbax-checkpoint-tmp``) in
Orbax's background thread once its writes have finished. That thread competes for the CPU and the
GIL with the training loop: with short host-bound steps its commit crawled until the loop next
blocked, in practice at the next save, so a step stayed uncommitted for ``every_steps`` steps and a
kill there lost two intervals. :meth:`TrainingSaver.written` says when the writes are done (Orbax's
own event, recorded right after them), and the loop then waits at the next step boundary
(:mod:`zaya_jax.train.checkpointing`) for the rest: the commit and the retention deletions Orbax
runs after it. A save is committed by the first step boundary after its writes finish, and the loop
never waits for unfinished writes there."""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from zaya_jax.checkpoint.base import base_record, check_base, save_args
from zaya_jax.checkpoint.fingerprint import digest
from zaya_jax.checkpoint.readable import check_step, quiet_orbax_leftovers, saved_items
from zaya_jax.checkpoint.store import (
    MODEL_ITEMS,
    BaseMismatchError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    array_fingerprints,
    data_filename,
    manager,
    saved_fingerprints,
    set_aside,
    verify,
)
from zaya_jax.config import Config, to_dict
from zaya_jax.files import read_json
from zaya_jax.lora.plan import EVERY_PARAMETER, ParameterPlan


def save_training(
    mgr: ocp.CheckpointManager,
    step: int,
    cfg: Config,
    state: Any,
    data_state: dict[str, Any],
    eval_loss: float | None = None,
    base: dict[str, Any] | None = None,
    parameters: ParameterPlan = EVERY_PARAMETER,
    ahead: list[dict[str, Any]] | None = None,
    per_process: bool = False,
) -> None:
    """Start saving a training checkpoint (async when the manager is; ``per_process``: a local
    tier's manager, :func:`~zaya_jax.checkpoint.store.manager`, each process saving its shards). ``state`` is a TrainState;
    ``eval_loss``, the held-out loss of this step if it was evaluated, ranks it for ``keep_best``.
    With a frozen base (``parameters``) only what trains is saved, with ``base``
    (:func:`~zaya_jax.checkpoint.base.base_record`) saying which base it belongs to. ``ahead``:
    weights the data position needs (``{"params", "balancing"}`` each: GRPO's rollouts sampled
    ahead), saved as the ``ahead`` item (:func:`restore_ahead`)."""
    if parameters.frozen_base and base is None:
        raise ValueError("a checkpoint of adapters needs the record of their base (base_record)")
    arrays = {
        "params": parameters.saved(state.params),
        "balancing": state.balancing,
        "train": {"step": state.step, "opt_state": state.opt_state, "controller": state.controller},
    }
    if ahead:
        arrays["ahead"] = {str(i): _saved_weights(w, parameters) for i, w in enumerate(ahead)}
    save = ocp.args.PyTreeSave if per_process else ocp.args.StandardSave
    mgr.save(
        step,
        args=ocp.args.Composite(
            **{name: save(tree) for name, tree in arrays.items()},
            fingerprints=ocp.args.JsonSave(array_fingerprints(arrays)),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(to_dict(cfg)),
            **(save_args(base) if base is not None else {}),
        ),
        metrics=None if eval_loss is None else {"eval_loss": float(eval_loss)},
        force=True,
    )


# Recorded by Orbax's async save thread once every commit future of a save (its writes) has finished,
# before the processes' barrier and the commit: orbax/checkpoint/_src/checkpointers/
# async_checkpointer.py, _background_wait_for_commit_futures. Should Orbax rename it, written() stays
# False and saves commit in the background only (tests/checkpoint/test_async_commit.py fails).
WRITES_DONE_EVENT = "/jax/checkpoint/write/async/commit_duration_sec"


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed, possibly in the background; complete checkpoints are untouched."""


class TrainingSaver:
    """Training-checkpoint saves that never fail silently.

    Wraps a :func:`manager`: a save that failed in the background (disk full, permissions, a lost
    filesystem) surfaces as :class:`CheckpointSaveError` at the next :meth:`check`, :meth:`save` or
    :meth:`finish`, naming the failed step and the complete checkpoints left to resume from.
    :meth:`written` says when an async save's writes are done, so that :meth:`finish` then waits
    for its commit (and retention's deletions) only.
    """

    def __init__(
        self,
        checkpoints_dir: str | Path,
        *,
        async_save: bool,
        keep: int | None,
        keep_every: int,
        keep_best: int = 0,
        parameters: ParameterPlan = EVERY_PARAMETER,
        per_process: bool = False,
    ):
        self.dir = Path(checkpoints_dir)
        self.parameters, self.per_process = parameters, per_process
        self.mgr = manager(
            self.dir, async_save=async_save, keep=keep, keep_every=keep_every, keep_best=keep_best,
            per_process=per_process,
        )  # fmt: skip
        self.pending: int | None = None  # the step of the save started last
        self._base: dict[str, Any] | None = None  # the frozen base's record, if the plan has one
        self._in_flight = False  # an async save started and not waited for yet
        self._written = threading.Event()  # set when that save's writes have finished
        self._listener = self._on_event if async_save else None
        if self._listener is not None:  # one listener per saver: removed by close()
            jax.monitoring.register_event_duration_secs_listener(self._listener)

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == WRITES_DONE_EVENT:  # in Orbax's save thread
            self._written.set()

    def _fail(self, err: BaseException) -> CheckpointSaveError:
        self.mgr.reload()
        complete = [s for s in self.mgr.all_steps() if s != self.pending]
        resume = f"resume from step {max(complete)}" if complete else "start from scratch"
        return CheckpointSaveError(
            f"saving the checkpoint of step {self.pending} in {self.dir} failed: {err}. Complete checkpoints "
            f"are intact ({sorted(complete) or 'none yet'}); fix the cause (disk space, permissions) and "
            f"rerun the same command to {resume}"
        )

    def reload(self) -> None:
        """Re-read the directory (after checkpoints were moved to quarantine)."""
        self.mgr.reload()

    def written(self) -> bool:
        """Whether the save in flight has finished its writes on this process, its commit (a
        barrier with the other processes, then metadata and renames) not yet waited for. With one
        async manager saving at a time in the process (another's writes would also set it, which
        costs a wait, never a wrong checkpoint)."""
        return self._in_flight and self._written.is_set()

    def check(self) -> None:
        """Raise the error of a background save that has failed since the last check."""
        try:
            self.mgr.check_for_errors()
        except Exception as err:
            raise self._fail(err) from err

    def save(
        self,
        step: int,
        cfg: Config,
        state: Any,
        data_state: dict[str, Any],
        eval_loss: float | None = None,
        ahead: list[dict[str, Any]] | None = None,
    ) -> None:
        """Start saving ``step`` once the previous save has completed (raising if it failed)."""
        self.finish()  # Orbax would wait for the previous save anyway; this names its step on failure
        self.pending = step
        if self._base is None:  # the frozen base, if any: fingerprinted once
            self._base = base_record(self.parameters, state.params)
        self._written.clear()  # before Orbax starts the thread that sets it
        self._in_flight = self._listener is not None
        try:
            save_training(
                self.mgr, step, cfg, state, data_state, eval_loss, self._base, self.parameters, ahead,
                self.per_process,
            )  # fmt: skip
        except Exception as err:
            raise self._fail(err) from err

    def finish(self) -> None:
        """Wait for the last save (once :meth:`written`, only its commit and retention's deletions);
        raise if it failed."""
        try:
            self.mgr.wait_until_finished()
        except Exception as err:
            raise self._fail(err) from err
        finally:
            self._in_flight = False
        self.check()

    def close(self) -> None:
        """Wait for the pending save and release the manager. While another exception is already
        propagating (the run is failing anyway), a save error here is logged instead of masking it."""
        in_flight = sys.exc_info()[1]  # set when called from a ``finally`` during an exception
        try:
            self.mgr.close()
        except Exception as err:
            if in_flight is None:
                raise self._fail(err) from err
            warnings.warn(str(self._fail(err)), stacklevel=2)
        finally:
            self._in_flight = False
            if self._listener is not None:
                jax.monitoring.unregister_event_duration_listener(self._listener)
                self._listener = None


def _saved_weights(weights: dict[str, Any], parameters: ParameterPlan) -> dict[str, Any]:
    return {"params": parameters.saved(weights["params"]), "balancing": weights["balancing"]}


def restore_ahead(
    checkpoints_dir: str | Path,
    step: int,
    like: Any,
    count: int,
    *,
    verify_arrays: bool = True,
    parameters: ParameterPlan = EVERY_PARAMETER,
    per_process: bool = False,
) -> list[dict[str, Any]] | None:
    """The ``count`` weights (``{"params", "balancing"}``, in the layout of the TrainState ``like``;
    a frozen base taken from it) saved as step ``step``'s ``ahead`` item, or None when the step
    holds another number of them or none (``per_process``: of a local tier)."""
    step_dir = Path(checkpoints_dir) / str(step)
    if "ahead" not in saved_items(step_dir):
        return None
    weights = {"params": like.params, "balancing": like.balancing}
    abstract = {str(i): _abstract(_saved_weights(weights, parameters)) for i in range(count)}
    mgr = manager(checkpoints_dir, per_process=per_process)
    try:
        args = ocp.args.Composite(ahead=restore_arg(abstract, per_process))
        try:
            restored = mgr.restore(step, args=args)["ahead"]
        except (ValueError, KeyError):  # saved with another rl.max_staleness: another tree
            return None
        if verify_arrays:
            verify(step_dir, saved_fingerprints(mgr, step_dir, step), {"ahead": restored})
    finally:
        mgr.close()
    return [
        {
            "params": parameters.restored(restored[str(i)]["params"], like.params),
            "balancing": restored[str(i)]["balancing"],
        }
        for i in range(count)
    ]


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def restore_arg(abstract: Any, per_process: bool = False) -> ocp.args.CheckpointArgs:
    """The Orbax argument restoring the arrays ``abstract`` describes, into their shardings."""
    if not per_process:
        return ocp.args.StandardRestore(abstract)
    return ocp.args.PyTreeRestore(
        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
    )


def restore_training(
    checkpoints_dir: str | Path,
    like: Any,
    *,
    verify_arrays: bool = True,
    parameters: ParameterPlan = EVERY_PARAMETER,
) -> tuple[tuple[Any, list[dict[str, Any]], int] | None, list[dict[str, Any]]]:
    """The latest readable training checkpoint restored into the structure and shardings of the
    TrainState ``like``: ((state, the data position of every saving process, step) or None when there
    is none, the unreadable ones).

    Restoring reads every array and (``verify_arrays``) checks it against its fingerprint; a
    checkpoint that cannot be read (torn or overwritten files, missing pieces) or reads back
    different is moved to ``<run>/quarantine/`` with a warning and the previous one is tried. Each
    one skipped is listed as ``{"checkpoint": step, "error", "moved_to"}``. With a frozen base
    (``parameters``) ``like`` carries it, loaded first, and each step's base record must match it."""
    mgr = manager(checkpoints_dir)
    quiet_orbax_leftovers()
    unreadable: list[dict[str, Any]] = []
    frozen = parameters.frozen(like.params)
    base = digest({"params": frozen}) if frozen is not None else None
    for step in sorted(mgr.all_steps(), reverse=True):
        step_dir = Path(checkpoints_dir) / str(step)
        try:
            if step_dir.is_dir() and "train" not in saved_items(step_dir):
                continue  # a model-only step (zaya convert): nothing to resume
            check_step(step_dir, (*MODEL_ITEMS, "train"))
            if base is not None:  # before any array is read: adapters of another base stop the run
                check_base(step_dir, base)
            return _restore_step(mgr, checkpoints_dir, step, like, verify_arrays, parameters), unreadable
        except (CheckpointNotFoundError, PermissionError, BaseMismatchError):
            raise
        except Exception as err:  # Orbax and TensorStore raise many types for unreadable files
            unreadable.append(set_aside(checkpoints_dir, step, err))
    return None, unreadable


def latest_step(checkpoints_dir: str | Path) -> int | None:
    """The newest committed step in ``checkpoints_dir`` (None: none, or no such directory)."""
    if not Path(checkpoints_dir).is_dir():
        return None
    return max(manager(checkpoints_dir).all_steps(), default=None)


def _restore_step(
    mgr: ocp.CheckpointManager,
    checkpoints_dir: str | Path,
    step: int,
    like: Any,
    verify_arrays: bool,
    parameters: ParameterPlan,
):
    step_dir = Path(checkpoints_dir) / str(step)
    data_states = saved_data_states(step_dir / "data")
    state, arrays = read_state(mgr, step, like, parameters)
    if verify_arrays:
        verify(step_dir, saved_fingerprints(mgr, step_dir, step), arrays)
    return state, data_states, step


def read_state(
    mgr: ocp.CheckpointManager, step: int, like: Any, parameters: ParameterPlan, per_process: bool = False
) -> tuple[Any, dict[str, Any]]:
    """Step ``step``'s train state in the layout of the TrainState ``like``, and its arrays as saved
    (what the fingerprints describe)."""
    train_like = {"step": like.step, "opt_state": like.opt_state, "controller": like.controller}
    saved = {"params": parameters.saved(like.params), "balancing": like.balancing, "train": train_like}
    restored = mgr.restore(
        step,
        args=ocp.args.Composite(**{k: restore_arg(_abstract(v), per_process) for k, v in saved.items()}),
    )
    arrays = {name: restored[name] for name in saved}
    train = restored["train"]
    state = like.replace(
        step=train["step"],
        params=parameters.restored(restored["params"], like.params),
        opt_state=train["opt_state"],
        balancing=restored["balancing"],
        controller=train["controller"],
    )
    return state, arrays


def saved_data_states(data_dir: Path) -> list[dict[str, Any]]:
    """The data positions every process of the saving run wrote into ``data_dir``, in process order
    (a run resumes on any number of processes: the producer merges them)."""
    names = sorted(p.name for p in data_dir.glob("process_*-of-*.json")) if data_dir.is_dir() else []
    if not names:
        raise CheckpointCorruptError(f"{data_dir} (the data position) is missing or empty")
    counts = {name.rsplit("-of-", 1)[1].removesuffix(".json") for name in names}
    count = int(counts.pop()) if len(counts) == 1 and next(iter(counts)).isdigit() else 0
    expected = [data_filename(p, count) for p in range(count)]
    if names != sorted(expected):
        raise CheckpointCorruptError(
            f"{data_dir} holds the data positions {names}, not one per saving process ({expected}): a "
            "process's file is missing"
        )
    return [read_json(data_dir / name, "a saved data position") for name in expected]
