"""The run's held-out evaluation as the loop calls it: of the starting weights (``eval.at_start``,
logged as step 0), every ``eval.every`` steps and after the final step, the objective's evaluator
(:attr:`zaya_jax.objectives.ObjectiveSpec.held_out`) on the step's state, its time left out of
tokens/s."""

from __future__ import annotations

import time
from collections.abc import Callable

from zaya_jax.config import Config
from zaya_jax.objectives import Evaluator
from zaya_jax.programs import TrainState
from zaya_jax.train.metrics import MetricsWriter, eval_record
from zaya_jax.train.throughput import Throughput


class Evaluation:
    """Calls the evaluator at the steps it is due (:meth:`due`); the metrics go into the step's
    record (``eval``), which the hooks and the checkpoints read."""

    def __init__(
        self,
        held_out: Evaluator,
        cfg: Config,
        meter: Throughput,
        timed: Callable[[str, float], None] = lambda kind, seconds: None,
    ):
        self.held_out, self.cfg, self.meter, self.timed = held_out, cfg, meter, timed

    def due(self, step: int) -> bool:
        return step % self.cfg.eval.every == 0 or step == self.cfg.train.steps

    def __call__(self, step: int, state: TrainState | None, stage: int = 0) -> dict[str, float] | None:
        """The held-out metrics after ``step`` of curriculum ``stage`` (``loss`` first), or None
        when it is not due."""
        if not self.due(step):
            return None
        started = time.perf_counter()
        metrics = self.held_out(step, state, stage)
        self.meter.pause(time.perf_counter() - started)  # tokens/s counts training only
        self.timed("evaluation", time.perf_counter() - started)  # the run's goodput
        return metrics

    def at_start(self, state: TrainState, writer: MetricsWriter) -> None:
        """The starting weights' held-out metrics as step 0's record (``eval.at_start``), so that
        every run's curve shows where it began (a GRPO run's ``eval_reward`` before its first update)."""
        if self.cfg.eval.at_start:
            started = time.perf_counter()
            writer.write(eval_record(0, self.held_out(0, state, 0)))
            self.timed("evaluation", time.perf_counter() - started)
