"""Model files: the parameters and balancing biases of a step (with its config), written by
``zaya convert`` and read by everything that uses a trained model, each array checked against its
fingerprint."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from zaya_jax.checkpoint.readable import first_readable
from zaya_jax.checkpoint.store import (
    CHECKPOINTS,
    MODEL_ITEMS,
    CheckpointCorruptError,
    array_fingerprints,
    manager,
    saved_fingerprints,
    verify,
)
from zaya_jax.config import Config, ConfigError, config_from_dict, save_config, to_dict

CONFIG_ITEMS = ("config",)


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
    stamps = ocp.args.JsonSave(array_fingerprints({name: variables[name] for name in MODEL_ITEMS}))
    mgr.save(
        step, args=ocp.args.Composite(config=ocp.args.JsonSave(to_dict(cfg)), fingerprints=stamps, **items)
    )
    mgr.wait_until_finished()
    mgr.close()
    return run_dir / CHECKPOINTS / str(step)


def _config(checkpoints: Path, step: int) -> Config:
    data = manager(checkpoints).restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))[
        "config"
    ]
    item = checkpoints / str(step) / "config" / "metadata"
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{item} does not hold a config (a JSON object)")
    try:
        return config_from_dict(data)
    except ConfigError as err:
        raise ConfigError(
            f"{item}: {err}; the checkpoint was written by another version of zaya-jax or its config was "
            "edited: fix the file, or load it with the version that wrote it"
        ) from err


def read_config(path: str | Path) -> tuple[Config, int]:
    """The config and step of a checkpoint (a run's latest readable step, see
    :mod:`zaya_jax.checkpoint.readable`), without reading any array."""
    return first_readable(path, _config, CONFIG_ITEMS)


def _arrays(checkpoints: Path, step: int) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = manager(checkpoints).item_metadata(step)
    return {
        name: jax.tree.map(lambda m: (tuple(m.shape), str(np.dtype(m.dtype))), dict(meta[name]))
        for name in MODEL_ITEMS
    }


def describe(path: str | Path) -> tuple[Config, int, dict[str, Any]]:
    """(config, step, {item: tree of (shape, dtype)}) of a checkpoint from its metadata alone."""
    (cfg, arrays), step = first_readable(
        path, lambda c, s: (_config(c, s), _arrays(c, s)), (*CONFIG_ITEMS, *MODEL_ITEMS)
    )
    return cfg, step, arrays


def restore_model(path: str | Path) -> tuple[Config, dict[str, Any], int]:
    """(config, variables, step) of a checkpoint, placed on the first local device, every array
    checked against its fingerprint. For a run directory a damaged latest step is set aside (with a
    warning) and the previous one used; a step directory given explicitly raises
    :class:`CheckpointCorruptError` instead (:mod:`zaya_jax.checkpoint.readable`)."""
    (cfg, variables), step = first_readable(path, _restore_model_step, (*CONFIG_ITEMS, *MODEL_ITEMS))
    return cfg, variables, step


def _restore_model_step(checkpoints: Path, step: int) -> tuple[Config, dict[str, Any]]:
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
    restored = mgr.restore(step, args=ocp.args.Composite(**args))
    variables = {name: restored[name] for name in MODEL_ITEMS}
    step_dir = checkpoints / str(step)
    verify(step_dir, saved_fingerprints(mgr, step_dir, step), variables)
    return _config(checkpoints, step), variables


def same_model_run(new: Path, existing: Path) -> bool:
    """Whether a run directory written by ``zaya convert hf-to-zaya`` holds what ``new`` holds: the
    same config.yaml bytes and one checkpoint (step 0) with the same config and arrays, bit for bit
    (Orbax's files themselves differ between two writes: random file names and timestamps)."""
    if (new / "config.yaml").read_bytes() != (existing / "config.yaml").read_bytes():
        return False
    names = {p.name for p in (existing / CHECKPOINTS).iterdir()}
    files = sorted(p.name for p in existing.iterdir())
    if sorted(names) != ["0"] or files != sorted(p.name for p in new.iterdir()):
        return False
    if not set(files) <= {CHECKPOINTS, "config.yaml", "tokenizer.json"}:
        return False
    if (
        "tokenizer.json" in files
        and (new / "tokenizer.json").read_bytes() != (existing / "tokenizer.json").read_bytes()
    ):
        return False
    try:
        cfg_a, vars_a, _ = restore_model(new)
        cfg_b, vars_b, _ = restore_model(existing)
    except Exception:
        return False
    leaves_a, tree_a = jax.tree.flatten(vars_a)
    leaves_b, tree_b = jax.tree.flatten(vars_b)
    return (
        cfg_a == cfg_b
        and tree_a == tree_b
        and all(
            a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(leaves_a, leaves_b, strict=True)
        )
    )
