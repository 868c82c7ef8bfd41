"""The train step as the training loop calls it: one executable per batch shape and model, as the
batch ramp and curriculum change them (a stage may change the RoPE:
:meth:`zaya_jax.programs.Programs.at_stage`), taken from the run's
:class:`zaya_jax.programs.Programs` (the held-out evaluation is the objective's,
:mod:`zaya_jax.objectives.held_out`).

Each is compiled ahead of its first call and the train step's planned memory checked against the
device's (:mod:`zaya_jax.train.fit`: a step that will not fit stops with settings that would),
then every process waits at a barrier: on CPU (gloo) a
process still compiling would otherwise trip its peers' collective timeout. Each compilation is
recorded as a ``compiled`` event with the program's fingerprint, the one ``--compile-only`` reports
for the same config and layout.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import jax

from zaya_jax.parallel.distributed import barrier
from zaya_jax.programs import Programs, TrainState, fingerprint
from zaya_jax.resilience import Watchdog
from zaya_jax.train.fit import (
    OutOfMemoryError,
    check_fit,
    is_out_of_memory,
    out_of_memory_message,
    peak_bytes,
)


class TrainStep:
    """``(state, batch, lr_scale, loss_limit) -> (state, metrics)``, compiled once per batch shape
    and per curriculum stage's model.
    :meth:`compile` may run before the run has a state or a writer (the fit check before the state
    is built); its ``compiled`` events wait for :meth:`attach`."""

    def __init__(self, programs: Programs, watchdog: Watchdog, event: Callable[..., None] | None = None):
        self.programs, self.watchdog, self.event = programs, watchdog, event
        self._compiled: dict[tuple[Any, ...], jax.stages.Compiled] = {}
        self._pending: list[dict[str, Any]] = []
        self.timed: Callable[[str, float], None] | None = None

    def attach(self, event: Callable[..., None], timed: Callable[[str, float], None] | None = None) -> None:
        """Events from here on go to ``event``, with the ones recorded before; compiles from here
        on are timed into ``timed("compile", seconds)`` (the run's goodput)."""
        self.event, self.timed = event, timed
        for detail in self._pending:
            event("compiled", **detail)
        self._pending.clear()

    def compile(self, rows: int, seq: int, stage: int = 0, after_step: int = 0) -> None:
        """Compile the step of curriculum ``stage``'s model for batches of ``rows`` x ``seq`` (once)
        and check that its plan fits the device (:func:`~zaya_jax.train.fit.check_fit`: stops with
        settings that would)."""
        shape, programs = (rows, seq), self.programs.at_stage(stage)
        key = (id(programs), *shape)  # stages with the same model share one programs object
        if key in self._compiled:
            return
        self.watchdog.beat(after_step, "compile")
        started = time.perf_counter()
        if jax.process_index() == 0:
            print(
                f"zaya train: compiling the train step for batches of {rows} x {seq} tokens...",
                file=sys.stderr,
                flush=True,
            )
        lowered = programs.lower_train_step(*shape)  # from abstract inputs, as planning does
        compiled = lowered.compile()
        memory = compiled.memory_analysis()
        detail = {"program": "train_step", "batch": list(shape), "fingerprint": fingerprint(lowered)}
        if programs is not self.programs:
            detail["stage"] = stage
        if memory is not None:
            detail["peak_bytes_per_device"] = peak_bytes(memory)
        if self.event is None:
            self._pending.append(detail)
        else:
            self.event("compiled", **detail)
        check_fit(programs, shape, compiled)  # before the step runs: stop with advice
        self._compiled[key] = compiled
        barrier(f"step {shape}", self.programs.cfg.runtime.barrier_timeout_s)
        if self.timed is not None:
            self.timed("compile", time.perf_counter() - started)

    def __call__(
        self,
        step: int,
        state: TrainState,
        batch: dict[str, jax.Array],
        lr_scale: float,
        loss_limit: float,
        stage: int = 0,
    ):
        args = self.programs.step_arguments(state, batch, lr_scale, loss_limit)
        key = (id(self.programs.at_stage(stage)), *batch["inputs"].shape)
        if key not in self._compiled:
            self.compile(*key[1:], after_step=step - 1, stage=stage)
        try:
            return self._compiled[key](*args)
        except jax.errors.JaxRuntimeError as err:
            if is_out_of_memory(err):
                raise OutOfMemoryError(out_of_memory_message(err, self.programs.cfg)) from None
            raise
