"""Resolving ``model.moe_impl: auto`` for a run's programs (:mod:`zaya_jax.model.moe_auto`): the
tokens each device's expert layer sees per micro-batch, measured (or cached) on this process's
first device, the same choice on every process (process 0's, broadcast), and a fixed choice where
nothing can be measured: with expert parallelism (the exchange runs the grouped matmul) and while
planning a GPU program on CPU (the GPU default, ``sorted``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np

from zaya_jax.config import Config
from zaya_jax.model.moe_auto import FALLBACK, PATHS, ChoiceCache, MoeChoice, choice_key, choose
from zaya_jax.ops.platform import planning_device_kind, planning_target
from zaya_jax.parallel import Layout


def cache_path() -> Path:
    """``$ZAYA_CACHE_DIR/moe_auto.json``, else ``$XDG_CACHE_HOME/zaya-jax/moe_auto.json``."""
    if os.environ.get("ZAYA_CACHE_DIR"):
        return Path(os.environ["ZAYA_CACHE_DIR"]).expanduser() / "moe_auto.json"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return root / "zaya-jax" / "moe_auto.json"


def tokens_per_device(cfg: Config, layout: Layout) -> int:
    """Tokens one device's expert layer runs per micro-batch of the run's final batch."""
    mesh = dict(layout.mesh.shape)
    rows = cfg.train.batch_size // cfg.train.micro_batches
    split = int(np.prod([mesh.get(axis, 1) for axis in ("data", "fsdp", "expert")]))
    return max(1, rows // split) * max(1, cfg.train.seq_len // mesh.get("context", 1))


def _agreed(choice: MoeChoice) -> MoeChoice:
    """Process 0's choice on every process (each traces the same program)."""
    if jax.process_count() == 1:
        return choice
    from jax.experimental import multihost_utils

    names = list(PATHS)
    index = int(multihost_utils.broadcast_one_to_all(np.int32(names.index(choice.impl))))
    if names[index] == choice.impl:
        return choice
    return MoeChoice(names[index], "process 0's choice", choice.key, choice.seconds)


def _planned_choice(cfg: Config, layout: Layout) -> MoeChoice:
    """While planning another platform's program: the choice cached for the named device kind
    (``--gpu-kind``) at these shapes, else ``sorted``, saying which."""
    kind = planning_device_kind()
    shapes = choice_key(cfg.model, tokens_per_device(cfg, layout), _Device()).partition("|")[2]
    found = ChoiceCache(cache_path()).find(kind, shapes) if kind else None
    if found is not None and found[1].get("impl") in PATHS:
        key, entry = found
        return MoeChoice(entry["impl"], f"cached for {key.partition('|')[0]}", key, entry.get("seconds", {}))
    why = f"no choice cached for {kind!r} at these shapes" if kind else "no --gpu-kind named"
    return MoeChoice(
        FALLBACK,
        f"planned for {planning_target()} on {jax.default_backend()}: {why} (zaya doctor --moe on it)",
    )


class _Device:
    """A blank device for a cache key whose shapes part alone is compared."""

    platform, device_kind = "", ""


def resolve_moe_impl(cfg: Config, layout: Layout, remeasure: bool = False) -> tuple[Config, MoeChoice]:
    """``cfg`` with ``model.moe_impl: auto`` replaced by its choice, and the choice; other values
    are kept as configured."""
    model = cfg.model
    if model.moe_impl != "auto":
        return cfg, MoeChoice(model.moe_impl, "configured")
    if dict(layout.mesh.shape).get("expert", 1) > 1:
        choice = MoeChoice(FALLBACK, "expert parallelism (the exchange runs the grouped matmul)")
    elif planning_target() is not None and planning_target() != jax.default_backend():
        choice = _planned_choice(cfg, layout)
    else:
        device = jax.local_devices()[0]
        choice = _agreed(
            choose(model, tokens_per_device(cfg, layout), device, ChoiceCache(cache_path()), remeasure)
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(model, moe_impl=choice.impl)), choice
