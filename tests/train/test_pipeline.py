"""The step pipeline's dispatch-ahead state machine, with fake states and no JAX: what is pending,
which step is finished when and with which state, the batch replayed after a rollback, and when an
agreed stop or time-based save acts."""

from __future__ import annotations

import dataclasses

from zaya_jax.train.pipeline import Finished, StepPipeline


@dataclasses.dataclass
class FakeSteps:
    """States are strings naming the step that made them ("s0" is the start); batches are numbered
    as drawn. ``outcomes[step]`` is what finishing that step gives (once), ``finish_at`` the steps
    that must be finished before the next dispatch."""

    outcomes: dict[int, dict] = dataclasses.field(default_factory=dict)
    finish_at: set[int] = dataclasses.field(default_factory=set)
    calls: list[tuple] = dataclasses.field(default_factory=list)
    drawn: int = 0

    def draw(self, state):
        self.drawn += 1
        self.calls.append(("draw", self.drawn, state))
        return self.drawn

    def dispatch(self, step, state, batch):
        self.calls.append(("dispatch", step, batch, state))
        return f"s{step}", step

    def finish(self, step, state, latest, time_save):
        self.calls.append(("finish", step, state, time_save))
        outcome = self.outcomes.pop(step, {})
        if "rollback_to" in outcome:
            return Finished(restored=(f"restored{outcome['rollback_to']}", outcome["rollback_to"]))
        return Finished(
            step, stop=outcome.get("stop"), time_save=outcome.get("time_save", False) and state is None
        )

    def must_finish(self, step):
        return step in self.finish_at


def _kinds(calls, kind):
    return [call[1:] for call in calls if call[0] == kind]


def test_each_step_is_finished_one_dispatch_late_and_the_last_with_its_state():
    steps = FakeSteps(finish_at={4})
    ran = StepPipeline(steps, ahead=True).run("s0", 1, 4)
    assert [c[:2] for c in steps.calls if c[0] != "draw"] == [
        ("dispatch", 1), ("dispatch", 2), ("finish", 1), ("dispatch", 3), ("finish", 2),
        ("dispatch", 4), ("finish", 3), ("finish", 4),
    ]  # fmt: skip
    # a step read late has no state (the next step consumed it); one finished at once has its own
    assert [(step, state) for step, state, _ in _kinds(steps.calls, "finish")] == [
        (1, None),
        (2, None),
        (3, None),
        (4, "s4"),
    ]
    assert (ran.step, ran.last, ran.stopped) == (4, 4, None)


def test_without_dispatch_ahead_every_step_is_finished_before_the_next():
    steps = FakeSteps()
    StepPipeline(steps, ahead=False).run("s0", 1, 3)
    assert [c[:2] for c in steps.calls if c[0] != "draw"] == [
        ("dispatch", 1), ("finish", 1), ("dispatch", 2), ("finish", 2), ("dispatch", 3), ("finish", 3)
    ]  # fmt: skip
    assert [state for _, state, _ in _kinds(steps.calls, "finish")] == ["s1", "s2", "s3"]


def test_an_on_policy_run_finishes_every_step_and_draws_from_its_state():
    steps = FakeSteps(finish_at={1, 2, 3})
    StepPipeline(steps, ahead=True).run("s0", 1, 3)
    assert [state for _, state, _ in _kinds(steps.calls, "finish")] == ["s1", "s2", "s3"]
    assert [state for _, state in _kinds(steps.calls, "draw")] == ["s0", "s1", "s2"]


def test_a_rollback_read_late_discards_the_next_step_and_replays_its_batch():
    """Step 3's outcome (read while step 4 runs) rolls back to step 2: step 4, dispatched from a
    state that no longer exists, is discarded and its batch trains again as step 3."""
    steps = FakeSteps(outcomes={3: {"rollback_to": 2}}, finish_at={5})
    ran = StepPipeline(steps, ahead=True).run("s0", 1, 5)
    dispatches = _kinds(steps.calls, "dispatch")
    assert [(step, batch) for step, batch, _ in dispatches] == [
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 4),
        (3, 4),
        (4, 5),
        (5, 6),
    ]
    assert dispatches[4][2] == "restored2"  # the replayed batch starts from the restored state
    assert len(_kinds(steps.calls, "draw")) == 6  # nothing drawn for the replay
    assert ran.step == 5 and ran.last == 5


def test_a_rollback_of_a_step_finished_at_once_draws_the_next_batch():
    steps = FakeSteps(outcomes={2: {"rollback_to": 1}}, finish_at={2, 3})
    StepPipeline(steps, ahead=True).run("s0", 1, 3)
    dispatches = [(step, batch, state) for step, batch, state in _kinds(steps.calls, "dispatch")]
    assert dispatches == [(1, 1, "s0"), (2, 2, "s1"), (2, 3, "restored1"), (3, 4, "s2")]


def test_a_stop_agreed_at_a_step_acts_at_the_next_which_is_finished_first():
    steps = FakeSteps(outcomes={2: {"stop": "SIGTERM"}})
    ran = StepPipeline(steps, ahead=True).run("s0", 1, 10)
    assert [c[:2] for c in steps.calls if c[0] != "draw"][-3:] == [
        ("dispatch", 3),
        ("finish", 2),
        ("finish", 3),
    ]
    assert _kinds(steps.calls, "finish")[-1] == (3, "s3", False)  # step 3 saved with its state
    assert ran.step == 3 and ran.last == 3 and ran.stopped.stop == "SIGTERM"
    assert max(step for step, *_ in _kinds(steps.calls, "dispatch")) == 3


def test_a_time_save_agreed_without_the_state_is_taken_at_the_next_finished_step():
    steps = FakeSteps(outcomes={2: {"time_save": True}}, finish_at={6})
    StepPipeline(steps, ahead=True).run("s0", 1, 6)
    finishes = _kinds(steps.calls, "finish")
    assert (3, "s3", True) in finishes  # step 3 is read at once, with its state, as a save
    assert [step for step, state, _ in finishes if state is not None] == [3, 6]


def test_a_run_already_complete_runs_nothing():
    steps = FakeSteps()
    ran = StepPipeline(steps, ahead=True).run("s0", 5, 4)
    assert steps.calls == [] and ran.last is None and ran.step == 4
