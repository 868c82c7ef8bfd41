"""The record of one finished step that the loop's collaborators and every hook receive."""

from __future__ import annotations

import dataclasses
from typing import Any

from zaya_jax.objectives import StepPlan
from zaya_jax.programs import TrainState


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """A finished (accepted or skipped) step as every hook sees it."""

    step: int
    state: TrainState | None  # after the step; None when the next step consumed it (Needs.state_at)
    data_state: dict[str, Any]  # the data position after the step's batch
    metrics: dict[str, Any]  # the step's outputs (device arrays)
    plan: StepPlan  # what the batch was drawn for
    counts: dict[str, int]  # skipped_steps, rollbacks so far
    last: bool  # the run's final step (saved by the loop's end)
    time_save: bool = False  # a time-based save is due, as agreed by every process
    eval: dict[str, float] | None = None  # the held-out metrics, when this step was evaluated
    saved: bool = False  # a checkpoint of this step was written (or is being written)
    save_written: bool = False  # the save in flight has finished its writes on every process (agreed)
    ahead: list[dict[str, Any]] | None = (
        None  # the producer's weights saved with the position (ahead_weights)
    )

    @property
    def eval_loss(self) -> float | None:
        return self.eval["loss"] if self.eval is not None else None
