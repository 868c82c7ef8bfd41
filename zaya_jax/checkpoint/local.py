"""The local checkpoint tier: every process saves its own shards of the train state to its node's
fast storage (``checkpoint.local_dir``: a RAM disk or a local SSD) and reads them back from there,
touching no other process's files and waiting for no other process.

Layout: ``<local_dir>/<run name>-<hash of the run's path>/process_<i>-of-<n>/checkpoints/<step>/``.
Processes sharing a node get a directory each, and a restart on another number of processes finds
no local step (a local step holds its process's shards only, which another layout cannot use).

Saving is Orbax's :class:`~orbax.checkpoint.CheckpointManager` with
:func:`~zaya_jax.checkpoint.store.manager`'s ``per_process`` items: each process is the primary of
its own directory and synchronises with no other, and writes one copy of every shard it holds (a
replicated array's too). Only the fingerprints are computed together (every array's, over the
global arrays, when the save starts): each process's step records the same values.

Restoring (:func:`restore_local`) is agreed, because a step is only usable when every process holds
its part: the processes exchange the steps they hold (through the coordination service), try the
newest step all of them hold and that is not older than the persistent tier's newest, each reads its
own shards, and they exchange whether that worked before computing the fingerprints of the
assembled global arrays together (a process that failed to read never reaches that collective). A
step that any process could not read, or whose fingerprints differ, is moved to the tier's
``quarantine/`` on every process and the next one is tried; with none left the caller restores the
persistent tier. Steps some processes hold and others do not (a process killed during the save) can
never be assembled: :func:`clear_after` deletes those newer than the step the run resumes from, so a
later save of that step number has room.

Why not Orbax's emergency checkpointing (0.12.8): its ``CheckpointManager`` needs at least two
data-parallel replicas along a replica axis of the mesh (with one it drops the local directory and
saves only the persistent checkpoint), each slice holding a full copy of the state and a restore
broadcasting one replica's copy to the rest; the FSDP and expert layouts over every device have no
such axis. Its ``ReplicatorCheckpointManager`` saves each process's shards locally, as here, but
assumes an outside replicator service copying them to persistent storage and has no persistent
fallback of its own. Its ``p2p/local.py`` is the per-process setup used here, without its barrier
between processes at every save."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from zaya_jax.checkpoint.base import check_base
from zaya_jax.checkpoint.fingerprint import digest
from zaya_jax.checkpoint.readable import check_step, one_line, quiet_orbax_leftovers
from zaya_jax.checkpoint.store import (
    MODEL_ITEMS,
    BaseMismatchError,
    CheckpointCorruptError,
    manager,
    saved_fingerprints,
    set_aside,
    verify,
)
from zaya_jax.checkpoint.training import read_state
from zaya_jax.lora.plan import EVERY_PARAMETER, ParameterPlan

# (name, this process's value) -> every process's value, in process order (the coordination
# service's key-value store: zaya_jax.parallel.distributed.gather_strings); None: no such service
Gather = Callable[[str, str], list[str] | None]


def local_tier(local_dir: str, run_path: Path) -> Path:
    """This process's local tier of the run at ``run_path``: ``<local_dir>/<run name>-<hash of its
    path>/process_<i>-of-<n>/checkpoints`` (two runs of one name in different places do not share
    it, nor do two processes of one node)."""
    where = Path(run_path).absolute()
    digest_ = hashlib.sha256(str(where).encode()).hexdigest()[:10]
    process = f"process_{jax.process_index()}-of-{jax.process_count()}"
    return Path(local_dir).expanduser() / f"{where.name}-{digest_}" / process / "checkpoints"


def restore_local(
    tier: Path,
    like: Any,
    *,
    not_before: int | None,
    mesh: dict[str, Any],
    gather: Gather,
    verify_arrays: bool = True,
    parameters: ParameterPlan = EVERY_PARAMETER,
) -> tuple[tuple[Any, list[dict[str, Any]], int] | None, list[dict[str, Any]]]:
    """The newest local step every process holds, reads and verifies, from ``not_before`` on (the
    persistent tier's newest step: an older local one is never better), restored into the layout
    of the TrainState ``like``: ((state, every process's data position, step) or None, the
    ``checkpoint_unreadable`` details of the steps moved to quarantine). Every process calls it.
    ``mesh``: the run's mesh config; a step saved under another one is not used. ``gather``: the
    exchange between processes."""
    mgr = manager(tier, per_process=True)
    quiet_orbax_leftovers()
    mesh = json.loads(json.dumps(mesh))  # as the saved config item reads back (lists, not tuples)
    frozen = parameters.frozen(like.params)  # a collective: before any process can fail alone
    base = digest({"params": frozen}) if frozen is not None else None
    try:
        held = [set(json.loads(s)) for s in _gather(gather, "held", json.dumps(sorted(mgr.all_steps())))]
        steps = sorted(
            (s for s in set.intersection(*held) if not_before is None or s >= not_before), reverse=True
        )
        unreadable = []
        for step in steps:
            restored, reasons = _try(mgr, tier, step, like, (mesh, base), verify_arrays, parameters, gather)
            if restored is not None:
                return restored, unreadable
            unreadable.append(set_aside(tier, step, CheckpointCorruptError("; ".join(reasons)), own=True))
        return None, unreadable
    finally:
        mgr.close()


def clear_after(tier: Path, step: int) -> list[int]:
    """Delete this process's local steps newer than ``step`` (the one the run resumes from): after
    :func:`restore_local` only steps that not every process holds are left there, which nothing can
    restore, and the run will save those step numbers again. Returns them."""
    stale = sorted(int(p.name) for p in tier.glob("[0-9]*") if p.name.isdigit() and int(p.name) > step)
    for s in stale:
        shutil.rmtree(tier / str(s), ignore_errors=True)
    if stale:
        warnings.warn(
            f"local checkpoint steps {stale} in {tier} were deleted: not every process held them (a process "
            f"stopped while saving), so they cannot be restored; the run resumes from step {step}",
            stacklevel=2,
        )
    return stale


def _gather(gather: Gather, name: str, value: str) -> list[str]:
    gathered = gather(f"local_tier_{name}", value)
    if gathered is None:  # pragma: no cover - several processes without jax.distributed
        raise RuntimeError("checkpoint.local_dir with several processes needs jax.distributed")
    return gathered


def _try(
    mgr: ocp.CheckpointManager,
    tier: Path,
    step: int,
    like: Any,
    expected: tuple[dict[str, Any], str | None],
    verify_arrays: bool,
    parameters: ParameterPlan,
    gather: Gather,
) -> tuple[tuple[Any, list[dict[str, Any]], int] | None, list[str]]:
    """(state, data positions, step) of ``step`` when every process read (and verified) its part,
    else (None, the reasons: "process i: why"). ``expected``: the run's mesh and frozen base digest."""
    (mesh, base), step_dir = expected, tier / str(step)
    state = arrays = data = saved = None
    try:
        check_step(step_dir, (*MODEL_ITEMS, "train"))
        if base is not None:  # adapters of another base: a config error on every process
            check_base(step_dir, base)
        records = mgr.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), data=ocp.args.JsonRestore())
        )
        if records["config"].get("mesh") != mesh:
            raise CheckpointCorruptError(
                f"saved under mesh {records['config'].get('mesh')}, not this run's {mesh}"
            )
        data = records["data"]
        state, arrays = read_state(mgr, step, like, parameters, per_process=True)
        saved = saved_fingerprints(mgr, step_dir, step) if verify_arrays else None
        why = ""
    except BaseMismatchError:
        raise
    except Exception as err:  # Orbax and TensorStore raise many types for unreadable files
        why = f"{type(err).__name__}: {one_line(err)}"[:600]
    reasons = _reasons(_gather(gather, f"read_{step}", why))
    if not reasons and verify_arrays:  # every process holds its arrays: the fingerprints, together
        try:
            verify(step_dir, saved, arrays)
        except CheckpointCorruptError as err:
            why = one_line(err)[:600]
        reasons = _reasons(_gather(gather, f"verify_{step}", why))
    if reasons:
        return None, reasons
    data_states = [json.loads(d) for d in _gather(gather, f"data_{step}", json.dumps(data))]
    return (state, data_states, step), []


def _reasons(gathered: list[str]) -> list[str]:
    return [f"process {i}: {why}" for i, why in enumerate(gathered) if why]
