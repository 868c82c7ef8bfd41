"""Fit before running: the train state's size against the device's memory before anything is
compiled or allocated (:func:`check_state_fits`), then the compiled train step's planned memory
before the state is built (:func:`check_fit`), with settings that would fit when it does not; and
an out-of-memory error at run time as one line with the same kind of advice. The numbers are
:mod:`zaya_jax.programs.memory`'s.

- **Need**: XLA's buffer assignment of the compiled step (arguments + temporaries + outputs -
  aliased), the number ``--compile-only`` prints as ``peak_bytes_per_device``.
- **Capacity**: ``runtime.memory_limit_gb`` where set (a shared or partitioned GPU), else the
  backend's ``bytes_limit`` on a GPU, else on CPU the host's available RAM (``MemAvailable``) plus
  the step's arguments already in memory, shared by the host's devices.
- **Advice**: more micro-batches (the smallest power-of-two multiple the batch and mesh allow whose
  compiled plan fits), ``model.moe_impl: sorted`` where the run computes every expert on every
  token (``dense``, which ``auto`` may have chosen for speed) and ``model.remat: full``. Each suggestion is compiled and its plan measured,
  not estimated from a formula, so what the message names fits; compiling costs seconds, and only
  on this failure path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from zaya_jax.config import Config
from zaya_jax.programs.memory import GB, peak_bytes, tree_bytes_per_device
from zaya_jax.programs.memory import device_capacity as memory_capacity

if TYPE_CHECKING:
    from zaya_jax.parallel import Layout
    from zaya_jax.programs import Programs

# Device memory of the accelerators the presets name (GB as the vendors state it, 1e9 bytes).
DEVICE_MEMORY_GB = {
    "l40s": 48.0,
    "h100": 80.0,
    "h200": 141.0,
    "b200": 180.0,
    "mi250x": 128.0,
    "mi300x": 192.0,
    "mi325x": 256.0,
}
MAX_ADVICE_COMPILES = 4


def size(nbytes: float) -> str:
    """Bytes as GB (1e9) or, under 1 GB, MB."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= GB else f"{nbytes / 1e6:.1f} MB"


class OutOfMemoryError(RuntimeError):
    """The train step does not fit (planned before the first step, or failed to allocate)."""


def device_capacity(cfg: Config, memory: Any) -> tuple[int | None, str]:
    """(bytes one device may use for the step, where the number comes from); None when unknown.
    On CPU the step's arguments, already in memory when it runs, are added to the RAM available."""
    capacity, source = memory_capacity(cfg.runtime.memory_limit_gb)
    if capacity is not None and jax.local_devices()[0].platform == "cpu" and cfg.runtime.memory_limit_gb <= 0:
        capacity += int(memory.argument_size_in_bytes)
    return capacity, source


def check_state_fits(cfg: Config, layout: Layout) -> None:
    """Raise :class:`OutOfMemoryError` at once, before anything is measured, compiled or allocated,
    when the train state alone (parameters and optimizer state, per device on ``layout``) exceeds
    the device's memory (the host's available RAM on CPU); ``runtime.check_fit: false`` skips it."""
    from zaya_jax.objectives import spec_for
    from zaya_jax.programs import Programs

    if not cfg.runtime.check_fit:
        return
    capacity, source = memory_capacity(cfg.runtime.memory_limit_gb)
    # the parameters' shapes do not depend on the kernels: nothing is resolved (or timed) for this
    shapes = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, moe_impl="sorted", attention_impl="blocked")
    )
    state = tree_bytes_per_device(Programs(shapes, layout, spec_for(cfg).loss).abstract_state)
    if capacity is None or state <= capacity:
        return
    raise OutOfMemoryError(
        f"the train state alone (parameters and optimizer state) is {size(state)} per device and the device "
        f"has {size(capacity)} ({source}): shard it over more devices (mesh.fsdp, mesh.expert) or use a "
        "smaller model. Plan layouts with zaya train --compile-only; runtime.check_fit=false skips this check"
    )


def _plan(programs: Programs, cfg: Config, shape: tuple[int, int]) -> int:
    from zaya_jax.programs import build_programs

    candidate = build_programs(cfg, programs.layout, objective=programs.objective, groups=programs.groups)
    return peak_bytes(candidate.lower_train_step(*shape).compile().memory_analysis())


def _micro_batch_choices(cfg: Config, rows: int, shards: int) -> list[int]:
    """Power-of-two multiples of the current count that every batch size of the run divides into
    micro-batches the mesh splits evenly."""
    sizes = {rows, *cfg.train.batch_sizes}
    choices, m = [], cfg.train.micro_batches * 2
    while all(size % m == 0 and (size // m) % shards == 0 for size in sizes):
        choices.append(m)
        m *= 2
    return choices


def advice(programs: Programs, shape: tuple[int, int], memory: Any, capacity: int) -> list[str]:
    """Settings that fit ``capacity``, each with its compiled plan: more micro-batches and/or full
    rematerialisation (at most ``MAX_ADVICE_COMPILES`` compilations)."""
    cfg = programs.cfg
    mesh = dict(programs.layout.mesh.shape)
    shards = math.prod(mesh.get(axis, 1) for axis in ("data", "fsdp", "expert"))
    choices = _micro_batch_choices(cfg, shape[0], shards)
    fixed = peak_bytes(memory) - int(memory.temp_size_in_bytes)
    found = []

    def replaced(**sections: dict[str, Any]) -> Config:
        return dataclasses.replace(
            cfg, **{name: dataclasses.replace(getattr(cfg, name), **v) for name, v in sections.items()}
        )

    # first the micro-batch count whose linear estimate (temporaries / m) fits, then larger ones
    start = next(
        (i for i, m in enumerate(choices) if fixed + memory.temp_size_in_bytes * cfg.train.micro_batches / m <= capacity),
        len(choices) - 1,
    )  # fmt: skip
    for m in choices[max(start, 0) :][: MAX_ADVICE_COMPILES - 1]:
        need = _plan(programs, replaced(train={"micro_batches": m}), shape)
        if need <= capacity:
            found.append(f"train.micro_batches={m} (plans {size(need)})")
            break
    if cfg.model.moe_impl == "dense":  # e.g. auto's choice: E times the expert activations of sorted
        need = _plan(programs, replaced(model={"moe_impl": "sorted"}), shape)
        if need <= capacity:
            found.append(f"model.moe_impl=sorted (plans {size(need)})")
    if cfg.model.remat != "full":
        need = _plan(programs, replaced(model={"remat": "full"}), shape)
        if need <= capacity:
            found.append(f"model.remat=full (plans {size(need)})")
    return found


def check_fit(programs: Programs, shape: tuple[int, int], compiled: jax.stages.Compiled) -> None:
    """Raise :class:`OutOfMemoryError` (one line: the need, the capacity, settings that fit) when
    the compiled step's plan exceeds the device's memory; nothing when it fits, when the capacity
    is unknown, or with ``runtime.check_fit: false``."""
    cfg = programs.cfg
    memory = compiled.memory_analysis()
    if not cfg.runtime.check_fit or memory is None:
        return
    capacity, source = device_capacity(cfg, memory)
    need = peak_bytes(memory)
    over = capacity is not None and need > capacity
    if jax.process_count() > 1:  # every process stops if one must (hosts' free RAM can differ)
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(over))
        if flags.any() and not over:
            raise OutOfMemoryError(
                f"process {int(np.argmax(flags))} has too little memory for the train step; see its message"
            )
    if not over:
        return
    fits = advice(programs, shape, memory, capacity)
    raise OutOfMemoryError(
        f"the train step for batches of {shape[0]} x {shape[1]} tokens plans {size(need)} per device "
        f"({size(memory.argument_size_in_bytes)} of state and batch, {size(memory.temp_size_in_bytes)} "
        f"of temporaries) and the device has {size(capacity)} ({source}); "
        + (
            f"settings that fit: {'; '.join(fits)}"
            if fits
            else "no micro-batch count or remat setting fits: shard the model over more devices "
            "(mesh.fsdp, mesh.expert), shorten train.seq_len or use a smaller model"
        )
        + ". Plan others with zaya train --compile-only; runtime.check_fit=false skips this check"
    )


def is_out_of_memory(err: BaseException) -> bool:
    """Whether an XLA runtime error is an allocation failure (``RESOURCE_EXHAUSTED``)."""
    return isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err)


def out_of_memory_message(err: BaseException, cfg: Config | None = None) -> str:
    """One line for an allocation failure at run time, with what to change."""
    first = next((line for line in str(err).splitlines() if "RESOURCE_EXHAUSTED" in line), str(err))
    where = (
        f" (train.batch_size={cfg.train.batch_size}, train.micro_batches={cfg.train.micro_batches}, "
        f"train.seq_len={cfg.train.seq_len}, model.remat={cfg.model.remat})"
        if cfg is not None
        else ""
    )
    return (
        f"out of device memory{where}: {' '.join(first.split())[:300]}. Raise train.micro_batches, set "
        "model.remat=full or shard over more devices; zaya train --compile-only prints the plan"
    )
