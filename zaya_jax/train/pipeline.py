"""Dispatch ahead as its own object: which step is pending, which step must be finished now and
with which state, and the batch to train again after a rollback. Plain Python with no JAX, so the
state machine is tested with fake states in milliseconds (``tests/train/test_pipeline.py``); the
loop supplies the work through :class:`Steps`.

With ``train.dispatch_ahead``, step t+1 is dispatched before step t's outcome is read, unless step
t must be finished first (``Steps.must_finish``: the last step, a step whose state is read, every
step of an on-policy objective). A rollback decided from step t discards step t+1 (its batch is
trained again after the restore); a stop or a time-based save agreed at step t is acted on at step
t+1, which is then finished before the next dispatch. MaxText keeps its one-step-deep metrics
buffer in the same way, out of the loop (``metric_logger.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Generic, Protocol, TypeVar

State = TypeVar("State")
Drawn = TypeVar("Drawn")
Dispatched = TypeVar("Dispatched")
Record = TypeVar("Record")


@dataclasses.dataclass(frozen=True)
class Finished(Generic[State, Record]):
    """What finishing a step gave: its record for the hooks, or a rollback (the restored state and
    its step), and what every process agreed to do next."""

    record: Record | None = None
    restored: tuple[State, int] | None = None
    stop: str | None = None  # the agreed stop signal
    stopped_by: tuple[int, ...] = ()
    time_save: bool = False  # a time-based save agreed at a step whose state was gone: take it next


class Steps(Protocol[State, Drawn, Dispatched, Record]):
    """The work the pipeline schedules (the loop's): draw a batch for a state, dispatch a step,
    finish a dispatched step (``state``: its state, or None when the next step consumed it;
    ``latest``: the newest state, the template a rollback restores into; ``time_save``: a save
    agreed at the step before), and whether a step must be finished before the next dispatch."""

    def draw(self, state: State) -> Drawn: ...

    def dispatch(self, step: int, state: State, drawn: Drawn) -> tuple[State, Dispatched]: ...

    def finish(
        self, done: Dispatched, state: State | None, latest: State, time_save: bool
    ) -> Finished[State, Record]: ...

    def must_finish(self, step: int) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Ran(Generic[State, Record]):
    """How the steps ended: the last step run (or stopped at), the last finished step's record,
    and the agreement that stopped the run (None: it ran to the end)."""

    step: int
    last: Record | None
    stopped: Finished[State, Record] | None


class StepPipeline(Generic[State, Drawn, Dispatched, Record]):
    """Runs steps ``first`` .. ``last`` through ``steps``, one step dispatched ahead when
    ``ahead``."""

    def __init__(self, steps: Steps[State, Drawn, Dispatched, Record], ahead: bool):
        self.steps, self.ahead = steps, ahead

    def run(self, state: State, first: int, last: int) -> Ran[State, Record]:
        steps = self.steps
        step, record = first, None
        pending: Dispatched | None = None
        replay: Drawn | None = None
        while step <= last:
            drawn, replay = replay if replay is not None else steps.draw(state), None
            state, current = steps.dispatch(step, state, drawn)
            late: Finished[State, Record] = Finished()
            if pending is not None:  # the previous step, read now that this one runs
                late, pending = steps.finish(pending, None, state, False), None
                if late.restored is not None:  # this step was dispatched from a discarded state
                    (state, restored_step), replay = late.restored, drawn
                    step = restored_step + 1
                    continue
                record = late.record
            if self.ahead and not (late.stop or late.time_save or steps.must_finish(step)):
                pending = current
                step += 1
                continue
            done = steps.finish(current, state, state, late.time_save)
            if done.restored is not None:
                state, restored_step = done.restored
                step = restored_step + 1
                continue
            record = done.record
            stopped = late if late.stop else done
            if stopped.stop:
                return Ran(step, record, stopped)
            step += 1
        return Ran(min(step, last), record, None)
