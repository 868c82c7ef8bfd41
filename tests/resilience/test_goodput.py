"""The goodput ledger with a fake clock: every second of wall time lands in exactly one kind, a
rollback moves the undone steps' time to badput, and a restart counts its gap and the earlier
attempt's steps after the checkpoint it resumed from (once, however many restarts)."""

from __future__ import annotations

import pytest

from zaya_jax.resilience.goodput import Goodput, attempts, describe, totals


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def _attempt(run, clock, from_step, steps, *, save_every=2, crash_after=None):
    """An attempt: 5 s of startup, then steps of 1 s (+0.25 s data wait, +0.5 s checkpoint at a save)."""
    ledger = Goodput(run, clock(), primary=True, clock=clock)
    ledger.resumed(from_step)
    clock.tick(5)
    ledger.start_loop()
    for step in range(from_step + 1, from_step + steps + 1):
        clock.tick(0.25)
        ledger.add("data_wait", 0.25)
        clock.tick(1.0)
        if step % save_every == 0:
            clock.tick(0.5)
            ledger.add("checkpoint", 0.5)
        ledger.step(step)
        if step % save_every == 0:
            ledger.saved(step)
        if step == crash_after:
            ledger.write()
            return None  # killed: no finish
    clock.tick(2)  # the final save
    return ledger.finish()


def test_one_attempt_splits_its_wall_time_into_productive_and_badput(tmp_path):
    clock = Clock()
    summary = _attempt(tmp_path, clock, 0, 4)
    assert summary["wall_s"] == pytest.approx(5 + 4 * 1.25 + 2 * 0.5 + 2)
    assert summary["productive_s"] == pytest.approx(4.0)
    bad = summary["badput_s"]
    assert (bad["startup"], bad["data_wait"], bad["checkpoint"]) == pytest.approx((5, 1.0, 3.0))
    assert summary["productive_s"] + sum(bad.values()) == pytest.approx(summary["wall_s"])
    assert describe(summary).startswith("goodput 30.8% of 13 s (1 attempts); badput: startup 38.5%")


def test_restarts_count_the_gap_and_the_redone_steps_once(tmp_path):
    clock = Clock()
    _attempt(tmp_path, clock, 0, 6, save_every=4, crash_after=6)  # saved 4, crashed after 6
    clock.tick(30)  # the supervisor's backoff
    _attempt(tmp_path, clock, 4, 1, save_every=100, crash_after=5)  # crashed again after step 5
    clock.tick(10)
    summary = _attempt(tmp_path, clock, 4, 4, save_every=100)  # steps 5-8, done
    assert [a["first_step"] for a in attempts(tmp_path)] == [1, 5, 5]
    bad = summary["badput_s"]
    assert bad["restart_gap"] == pytest.approx(40.0)
    assert bad["lost"] == pytest.approx(2.0 + 1.0)  # steps 5-6 of the first attempt, step 5 of the second
    assert summary["productive_s"] == pytest.approx(8.0)  # steps 1-8, each once
    assert summary["productive_s"] + sum(bad.values()) == pytest.approx(summary["wall_s"])


def test_a_rollback_moves_the_undone_steps_to_badput(tmp_path):
    clock = Clock()
    ledger = Goodput(tmp_path, clock(), primary=True, clock=clock)
    ledger.resumed(0)
    ledger.start_loop()
    for step in (1, 2, 3):
        clock.tick(1)
        ledger.step(step)
        if step == 2:
            ledger.saved(2)
    clock.tick(1)
    ledger.rolled_back(2)  # step 3 undone, and this step (the bad one) too
    ledger.step(3, "rollback")
    summary = ledger.finish()
    assert summary["productive_s"] == pytest.approx(2.0)
    assert summary["badput_s"]["rollback"] == pytest.approx(2.0)
    assert totals([]) is None
