"""An async save commits at the first step boundary after its writes have finished, not at the next
save: Orbax's background commit, starved by a busy loop, used to finish only when the loop next
blocked (issue 38: step 4 still ``4.orbax-checkpoint-tmp`` at step 8)."""

from __future__ import annotations

import threading
from pathlib import Path

import orbax.checkpoint as ocp
import pytest

from tests.fixtures import MINI
from zaya_jax.train import consensus
from zaya_jax.train.decisions import Action
from zaya_jax.train.hooks import Hook, RunContext, StepRecord

SAFETY_S = 120  # only a broken run waits this long: the test waits on conditions, never on a timer


class CommitGate:
    """Holds each background commit until the loop waits for its save (a manager's
    ``wait_until_finished`` from outside ``save``), as a starved commit thread effectively is:
    deterministic where the real starvation depends on the machine's load."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.released = True  # no save in flight
        self.in_save = False
        self.arrived = threading.Event()  # a commit is held: its writes have finished

    def start_save(self) -> None:
        with self.cond:
            self.in_save, self.released = True, False

    def end_save(self) -> None:
        with self.cond:
            self.in_save = False

    def waited(self) -> None:
        with self.cond:
            if not self.in_save:  # save()'s own wait is for the previous save
                self.released = True
                self.cond.notify_all()

    def hold(self) -> None:
        if threading.current_thread() is threading.main_thread():
            return  # a synchronous save
        self.arrived.set()
        with self.cond:
            if not self.cond.wait_for(lambda: self.released, timeout=SAFETY_S):
                raise TimeoutError("the commit was never waited for")


@pytest.fixture
def gate(monkeypatch) -> CommitGate:
    gate = CommitGate()
    manager, handler = ocp.CheckpointManager, ocp.CompositeCheckpointHandler
    save, wait, finalize = manager.save, manager.wait_until_finished, handler.finalize

    def gated_save(self, *args, **kwargs):
        gate.start_save()
        try:
            return save(self, *args, **kwargs)
        finally:
            gate.end_save()

    def gated_wait(self):
        gate.waited()
        return wait(self)

    def gated_finalize(self, directory):  # the commit's first part, after every write
        gate.hold()
        return finalize(self, directory)

    monkeypatch.setattr(manager, "save", gated_save)
    monkeypatch.setattr(manager, "wait_until_finished", gated_wait)
    monkeypatch.setattr(handler, "finalize", gated_finalize)
    return gate


class Observe(Hook):
    """Step 3's save has its writes held (its data item) until the hook releases them at step 4;
    the checkpoints directory is listed at steps 4 and 5, after the checkpoints' turn."""

    def __init__(self, gate: CommitGate):
        self.gate, self.writes, self.listed = gate, threading.Event(), {}

    def start(self, run: RunContext) -> None:
        self.dir = run.run.checkpoints

    def after_step(self, record: StepRecord) -> None:
        self.listed[record.step] = sorted(p.name for p in Path(self.dir).iterdir())
        if record.step == 4:
            self.writes.set()
            if not self.gate.arrived.wait(SAFETY_S):  # every write of step 3 has finished
                raise TimeoutError("step 3's save never finished writing")


def test_a_save_is_committed_at_the_first_step_boundary_after_its_writes(tmp_path, gate, monkeypatch):
    from zaya_jax.config import load_config
    from zaya_jax.train.loop import train

    handler = ocp.JsonCheckpointHandler
    write = handler._save_fn
    observe = Observe(gate)

    async def held_write(self, item, directory):  # in a write thread of Orbax's
        if Path(directory).name.startswith("data.") and Path(directory).parent.name.startswith("3."):
            observe.writes.wait(SAFETY_S)
        return await write(self, item, directory)

    monkeypatch.setattr(handler, "_save_fn", held_write)
    overrides = ["train.steps=6", "checkpoint.every_steps=3", "checkpoint.async_save=true", "eval.every=100"]
    train(
        load_config("tiny", [*MINI, f"run.dir={tmp_path / 'run'}", *overrides]),
        progress=False,
        hooks=[observe],
    )
    # step 4 went on while step 3's writes were unfinished: the loop never waits for them
    assert observe.listed[4] == ["3.orbax-checkpoint-tmp"]
    # they finished before step 5's boundary: its commit was waited for there, not left to step 6's save
    assert observe.listed[5] == ["3"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["3", "6"]


@pytest.mark.parametrize(("written", "agreed"), [((True, True), True), ((True, False), False)])
def test_the_save_in_flight_is_committed_only_once_every_process_has_written_it(monkeypatch, written, agreed):
    def gather(name, value, timeout_s):  # this process's proposal and the other's
        ints, health = value.split("|")  # four integers, then the health findings
        other = [*ints.split(",")[:3], str(int(written[1]))]
        return [value, ",".join(other) + "|" + health]

    monkeypatch.setattr(consensus, "gather_strings", gather)
    result = consensus.agree(1, time_due=False, stop=None, action=Action.ACCEPT, written=written[0])
    assert result.save_written is agreed
