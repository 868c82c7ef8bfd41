"""Orbax checkpoints behind a small interface.

Layout of a run directory::

    <run>/config.yaml                 the resolved config
    <run>/checkpoints/<step>/         one Orbax checkpoint per step, items:
        params/                       the model parameters
        balancing/                    the router balancing biases (non-gradient state)
        config/                       the resolved config again, so a step directory stands alone
        fingerprints/                 a fingerprint of every array above (checkpoint.fingerprint)
        train/                        (training checkpoints) step, optimizer and controller state
        data/                         (training checkpoints) the data position: tokens seen, stage, iterator

Only committed checkpoints (Orbax's atomic rename) are listed and restored. Restoring builds the
target shapes from the saved metadata with the *current* devices' sharding, so a checkpoint saved on
any mesh loads on a single CPU. Restored arrays are checked against their fingerprints; a checkpoint
that cannot be read or fails the check is moved to ``<run>/quarantine/`` and the previous one used.
Retention (``keep``, ``keep_every``, ``keep_best``) is Orbax's preservation policies: a pure function
of the steps and their saved held-out losses, so every process decides the same, and the latest
step (the one a resume or a rollback needs) is always kept.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from zaya_jax.checkpoint.fingerprint import fingerprints, mismatches, stored_in
from zaya_jax.config import Config, config_from_dict, save_config, to_dict

MODEL_ITEMS = ("params", "balancing")
CHECKPOINTS = "checkpoints"


class CheckpointNotFoundError(FileNotFoundError):
    """No complete checkpoint where one was expected; the message says where it looked."""


class CheckpointCorruptError(RuntimeError):
    """A restored array differs from what was saved (bytes changed on disk); names the arrays."""


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "balancing": ocp.StandardCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
        "fingerprints": ocp.JsonCheckpointHandler(),
        "train": ocp.StandardCheckpointHandler(),
        # Every process saves and restores its own data position (its share of the rows).
        "data": ocp.JsonCheckpointHandler(
            filename=_data_filename(),
            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None),
        ),
    }


def _data_filename() -> str:
    return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


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
    return ocp.CheckpointManager(Path(checkpoints_dir).absolute(), options=options, item_handlers=_handlers())


def _eval_loss(metrics: dict[str, Any]) -> float:
    return float(metrics["eval_loss"])


def save_training(
    mgr: ocp.CheckpointManager,
    step: int,
    cfg: Config,
    state: Any,
    data_state: dict[str, Any],
    eval_loss: float | None = None,
) -> None:
    """Start saving a training checkpoint (async when the manager is). ``state`` is a TrainState;
    ``eval_loss``, the held-out loss of this step if it was evaluated, ranks it for ``keep_best``."""
    arrays = {
        "params": state.params,
        "balancing": state.balancing,
        "train": {"step": state.step, "opt_state": state.opt_state, "controller": state.controller},
    }
    mgr.save(
        step,
        args=ocp.args.Composite(
            **{name: ocp.args.StandardSave(tree) for name, tree in arrays.items()},
            fingerprints=ocp.args.JsonSave(_fingerprints(arrays)),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(to_dict(cfg)),
        ),
        metrics=None if eval_loss is None else {"eval_loss": float(eval_loss)},
        force=True,
    )


def _fingerprints(items: dict[str, Any]) -> dict[str, str]:
    return {k: v for name, tree in items.items() for k, v in fingerprints(tree, f"{name}/").items()}


def verify(step_dir: Path, saved: dict[str, str] | None, restored: dict[str, Any]) -> None:
    """Raise :class:`CheckpointCorruptError` naming every restored array whose fingerprint differs
    from the one recorded at save time (``saved`` None: a checkpoint written before fingerprints)."""
    if saved is None:
        return
    bad = mismatches(saved, _fingerprints(restored))
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


def _saved_fingerprints(mgr: ocp.CheckpointManager, step_dir: Path, step: int) -> dict[str, str] | None:
    if not (step_dir / "fingerprints").is_dir():
        return None
    return mgr.restore(step, args=ocp.args.Composite(fingerprints=ocp.args.JsonRestore()))["fingerprints"]


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed, possibly in the background; complete checkpoints are untouched."""


class TrainingSaver:
    """Training-checkpoint saves that never fail silently.

    Wraps a :func:`manager`: a save that failed in the background (disk full, permissions, a lost
    filesystem) surfaces as :class:`CheckpointSaveError` at the next :meth:`check`, :meth:`save` or
    :meth:`finish`, naming the failed step and the complete checkpoints left to resume from.
    """

    def __init__(
        self,
        checkpoints_dir: str | Path,
        *,
        async_save: bool,
        keep: int | None,
        keep_every: int,
        keep_best: int = 0,
    ):
        self.dir = Path(checkpoints_dir)
        self.mgr = manager(
            self.dir, async_save=async_save, keep=keep, keep_every=keep_every, keep_best=keep_best
        )
        self.pending: int | None = None  # the step of the save started last

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

    def check(self) -> None:
        """Raise the error of a background save that has failed since the last check."""
        try:
            self.mgr.check_for_errors()
        except Exception as err:
            raise self._fail(err) from err

    def save(
        self, step: int, cfg: Config, state: Any, data_state: dict[str, Any], eval_loss: float | None = None
    ) -> None:
        """Start saving ``step`` once the previous save has completed (raising if it failed)."""
        self.finish()  # Orbax would wait for the previous save anyway; this names its step on failure
        self.pending = step
        try:
            save_training(self.mgr, step, cfg, state, data_state, eval_loss)
        except Exception as err:
            raise self._fail(err) from err

    def finish(self) -> None:
        """Wait for the last save; raise if it failed."""
        try:
            self.mgr.wait_until_finished()
        except Exception as err:
            raise self._fail(err) from err
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


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


QUARANTINE = "quarantine"


def quarantine(checkpoints_dir: str | Path, step: int) -> Path:
    """Move an unreadable checkpoint out of the checkpoints directory (never delete it) to
    ``<run>/quarantine/<step>-<time>``, so a later save of the same step has room."""
    source = Path(checkpoints_dir) / str(step)
    target = Path(checkpoints_dir).parent / QUARANTINE / f"{step}-{int(time.time())}"
    target.parent.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0 and source.exists():
        source.rename(target)
    return target


def restore_training(
    checkpoints_dir: str | Path, like: Any, *, verify_arrays: bool = True
) -> tuple[tuple[Any, dict[str, Any], int] | None, list[dict[str, Any]]]:
    """The latest readable training checkpoint restored into the structure and shardings of the
    TrainState ``like``: ((state, data_state, step) or None when there is none, the unreadable ones).

    Restoring reads every array and (``verify_arrays``) checks it against its fingerprint; a
    checkpoint that cannot be read (torn or overwritten files, missing pieces) or reads back
    different is moved to ``<run>/quarantine/`` with a warning and the previous one is tried. Each
    one skipped is listed as ``{"checkpoint": step, "error", "moved_to"}``."""
    mgr = manager(checkpoints_dir)
    steps = [s for s in mgr.all_steps() if (Path(checkpoints_dir) / str(s) / "train").is_dir()]
    unreadable: list[dict[str, Any]] = []
    for step in sorted(steps, reverse=True):
        try:
            return _restore_step(mgr, checkpoints_dir, step, like, verify_arrays), unreadable
        except CheckpointNotFoundError:
            raise
        except Exception as err:
            unreadable.append(_set_aside(checkpoints_dir, step, err))
    return None, unreadable


def _set_aside(checkpoints_dir: str | Path, step: int, err: Exception) -> dict[str, Any]:
    """Quarantine an unreadable or corrupt step, with a warning; its ``checkpoint_unreadable`` detail."""
    moved = quarantine(checkpoints_dir, step)
    warnings.warn(
        f"checkpoint step {step} in {checkpoints_dir} cannot be used ({type(err).__name__}: "
        f"{str(err)[:600]}); moved to {moved}, trying the previous one",
        stacklevel=3,
    )
    return {"checkpoint": step, "error": f"{type(err).__name__}: {str(err)[:1000]}", "moved_to": str(moved)}


def _restore_step(
    mgr: ocp.CheckpointManager, checkpoints_dir: str | Path, step: int, like: Any, verify_arrays: bool
):
    train_like = {"step": like.step, "opt_state": like.opt_state, "controller": like.controller}
    step_dir = Path(checkpoints_dir) / str(step)
    data_dir = step_dir / "data"
    if not (data_dir / _data_filename()).is_file():
        saved = sorted(p.name for p in data_dir.glob("process_*.json"))
        raise CheckpointNotFoundError(
            f"{data_dir} holds the data positions {saved} but this run is process {jax.process_index()} of "
            f"{jax.process_count()}; resume with the number of processes that saved it"
        )
    restored = mgr.restore(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(like.params)),
            balancing=ocp.args.StandardRestore(_abstract(like.balancing)),
            train=ocp.args.StandardRestore(_abstract(train_like)),
            data=ocp.args.JsonRestore(),
        ),
    )
    if verify_arrays:
        arrays = {name: restored[name] for name in ("params", "balancing", "train")}
        verify(step_dir, _saved_fingerprints(mgr, step_dir, step), arrays)
    train = restored["train"]
    state = like.replace(
        step=train["step"],
        params=restored["params"],
        opt_state=train["opt_state"],
        balancing=restored["balancing"],
        controller=train["controller"],
    )
    return state, restored["data"], step


def save_model(run_dir: str | Path, cfg: Config, variables: dict[str, Any], step: int = 0) -> Path:
    """Write ``config.yaml`` and a model-only checkpoint at ``step``; returns the step directory.

    Refuses to overwrite an existing step: nothing already saved is replaced.
    """
    run_dir = Path(run_dir)
    mgr = manager(run_dir / CHECKPOINTS)
    if step in mgr.all_steps():
        raise FileExistsError(
            f"{run_dir / CHECKPOINTS / str(step)} already exists; choose another destination"
        )
    save_config(cfg, run_dir / "config.yaml")
    items = {name: ocp.args.StandardSave(variables[name]) for name in MODEL_ITEMS}
    stamps = ocp.args.JsonSave(_fingerprints({name: variables[name] for name in MODEL_ITEMS}))
    mgr.save(
        step, args=ocp.args.Composite(config=ocp.args.JsonSave(to_dict(cfg)), fingerprints=stamps, **items)
    )
    mgr.wait_until_finished()
    mgr.close()
    return run_dir / CHECKPOINTS / str(step)


def resolve(path: str | Path) -> tuple[Path, int]:
    """(checkpoints dir, step) for a run directory (latest step) or a step directory."""
    path = Path(path)
    if (path / CHECKPOINTS).is_dir():
        checkpoints, step = path / CHECKPOINTS, None
    elif path.parent.name == CHECKPOINTS and path.name.isdigit():
        checkpoints, step = path.parent, int(path.name)
    else:
        raise CheckpointNotFoundError(
            f"{path} is neither a run directory (with {CHECKPOINTS}/) nor a step directory ({CHECKPOINTS}/<step>)"
        )
    steps = manager(checkpoints).all_steps()
    if step is None:
        if not steps:
            raise CheckpointNotFoundError(f"{checkpoints} holds no complete checkpoint")
        step = max(steps)
    elif step not in steps:
        raise CheckpointNotFoundError(
            f"{checkpoints / str(step)} is not a complete checkpoint (complete: {sorted(steps)})"
        )
    return checkpoints, step


def read_config(path: str | Path) -> tuple[Config, int]:
    """The config and step of a checkpoint, without reading any array."""
    checkpoints, step = resolve(path)
    data = manager(checkpoints).restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))[
        "config"
    ]
    return config_from_dict(data), step


def array_metadata(path: str | Path) -> tuple[int, dict[str, Any]]:
    """(step, {item: tree of (shape, dtype)}) from the checkpoint metadata only."""
    checkpoints, step = resolve(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = manager(checkpoints).item_metadata(step)
    trees = {}
    for name in MODEL_ITEMS:
        tree = meta[name]
        trees[name] = jax.tree.map(lambda m: (tuple(m.shape), str(np.dtype(m.dtype))), dict(tree))
    return step, trees


def restore_model(path: str | Path) -> tuple[Config, dict[str, Any], int]:
    """(config, variables, step) of a checkpoint, placed on the first local device, every array
    checked against its fingerprint. For a run directory a corrupt latest step is quarantined (with
    a warning) and the previous one used; a step directory given explicitly raises
    :class:`CheckpointCorruptError` instead."""
    checkpoints, step = resolve(path)
    explicit = Path(path).parent.name == CHECKPOINTS
    set_aside: set[int] = set()
    while True:
        try:
            return _restore_model_step(checkpoints, step)
        except CheckpointCorruptError as err:
            if explicit:
                raise
            _set_aside(checkpoints, step, err)
            set_aside.add(step)
            remaining = [s for s in manager(checkpoints).all_steps() if s not in set_aside]
            if not remaining:
                raise CheckpointNotFoundError(
                    f"{checkpoints} holds no checkpoint that passes its check"
                ) from err
            step = max(remaining)


def _restore_model_step(checkpoints: Path, step: int) -> tuple[Config, dict[str, Any], int]:
    mgr = manager(checkpoints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = mgr.item_metadata(step)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    args = {
        name: ocp.args.StandardRestore(
            jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), dict(meta[name]))
        )
        for name in MODEL_ITEMS
    }
    restored = mgr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), **args))
    variables = {name: restored[name] for name in MODEL_ITEMS}
    step_dir = checkpoints / str(step)
    verify(step_dir, _saved_fingerprints(mgr, step_dir, step), variables)
    return config_from_dict(restored["config"]), variables, step
