"""Which platform's program is traced: the backend's own (``jax.lax.platform_dependent`` picks per
lowering platform), or, while planning a cluster job on CPU, the GPU program.

``zaya train --compile-only`` compiles the training step on fake CPU devices to read XLA's memory
plan. Left alone, every platform-dependent op would take its CPU branch there, and the plan would
describe a program no GPU runs. Inside :func:`planning_for` ``("gpu")`` the GPU branch is traced
instead; where XLA:CPU cannot compile a GPU op as the GPU does, a *memory twin* stands in: an op
with the same operands, results, FLOPs and buffers (e.g. ``ragged_dot``, which XLA:CPU expands into
one dense product per group, a GPU runs as one grouped GEMM).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax

Target = Literal["cpu", "gpu"]

_TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar("zaya_planning_target", default=None)
_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar("zaya_planning_device_kind", default=None)


@contextlib.contextmanager
def planning_for(target: Target, device_kind: str | None = None) -> Iterator[None]:
    """Trace the programs built inside this block for ``target`` ("cpu" or "gpu"), whatever the
    backend; ``device_kind`` (e.g. "H200", "MI300X") names the GPU whose measured choices (the
    MoE path of ``moe_impl: auto``) the plan takes. Use around ``jit(...).lower(...)``: the choice
    is made while tracing."""
    if target not in ("cpu", "gpu"):
        raise ValueError(f"planning target must be 'cpu' or 'gpu', got {target!r}")
    token, kind = _TARGET.set(target), _KIND.set(device_kind)
    try:
        yield
    finally:
        _TARGET.reset(token)
        _KIND.reset(kind)


def planning_device_kind() -> str | None:
    """The device kind set by :func:`planning_for`, or None."""
    return _KIND.get()


def planning_target() -> Target | None:
    """The target set by :func:`planning_for`, or None (each backend runs its own branch)."""
    return _TARGET.get()


def planning_gpu_on_cpu() -> bool:
    """True while tracing the GPU program for a CPU backend (memory twins stand in)."""
    return _TARGET.get() == "gpu" and jax.default_backend() == "cpu"


def platform_branch(*args: Any, cpu: Callable, gpu: Callable, gpu_twin: Callable | None = None) -> Any:
    """``cpu(*args)`` on CPU and ``gpu(*args)`` elsewhere (ROCm, CUDA, TPU), chosen when lowering;
    inside :func:`planning_for` the planned target's branch, with ``gpu_twin`` for ``gpu`` when
    the program is compiled by XLA:CPU."""
    target = _TARGET.get()
    if target == "cpu":
        return cpu(*args)
    if target == "gpu":
        return (gpu_twin if gpu_twin is not None and jax.default_backend() == "cpu" else gpu)(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=gpu)
