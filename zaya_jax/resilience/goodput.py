"""Goodput: how much of a run's wall time trained.

Every attempt (one ``zaya train`` process, first start or restart) is a ledger: the time of the
steps it kept (**productive**) and each kind of **badput**, which together add up to the attempt's
wall time by construction (each interval between two finished steps is split into what was
measured inside it and the step itself):

- ``startup``: process start to the first step (runtime set-up, health checks, the first compile,
  the restore or initialisation, the objective's preparation);
- ``compile``: compiling again during the run (a new batch shape);
- ``data_wait``: waiting for the producer's next batch;
- ``checkpoint``: saves blocking the loop, the final save and closing;
- ``evaluation``: held-out evaluation;
- ``skipped``: steps whose update was thrown away (non-finite loss, spike, bound);
- ``rollback``: restoring after a rollback, and the steps it undid (their productive time moves here);
- ``lost``: productive time of earlier attempts after the checkpoint this one resumed from (redone);
- ``restart_gap``: from an earlier attempt's last record to this attempt's start (a crash, the
  supervisor's backoff, a requeue's wait).

``<run>/goodput.json`` keeps every attempt (process 0 writes it at saves, at most every 30 s, and
at the end), so the totals (:func:`totals`) span restarts: ``zaya inspect RUN``, ``summary.json``
and ``zaya supervise`` report them. MaxText's ml-goodput-measurement library does this for TPU
jobs through Cloud Logging; this one needs only the run directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from zaya_jax.files import write_atomic

GOODPUT = "goodput.json"
KINDS = (
    "startup", "compile", "data_wait", "checkpoint", "evaluation", "skipped", "rollback", "lost", "restart_gap",
)  # fmt: skip
_KEEP_SAVES = 64  # the productive time at the newest saves, for the next attempt's "lost"


def attempts(run_dir: Path) -> list[dict[str, Any]]:
    """The attempts recorded in ``<run>/goodput.json`` ([] when none or unreadable)."""
    try:
        return json.loads((Path(run_dir) / GOODPUT).read_text())["attempts"]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def totals(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's goodput over ``records`` (attempts): wall time, productive time, badput by kind."""
    if not records:
        return None
    badput = {kind: sum(a["badput_s"].get(kind, 0.0) for a in records) for kind in KINDS}
    wall = sum(a["ended"] - a["started"] for a in records) + badput["restart_gap"]
    productive = sum(a["productive_s"] for a in records) - badput["lost"]
    return {
        "goodput": productive / wall if wall > 0 else None,
        "wall_s": wall,
        "productive_s": productive,
        "badput_s": badput,
        "attempts": len(records),
    }


def describe(summary: dict[str, Any] | None) -> str:
    """One line: ``goodput 83.1% of 2.1 h (3 attempts); badput: startup 4.0%, ...``."""
    if not summary or not summary["wall_s"]:
        return "goodput: not recorded"
    wall = summary["wall_s"]
    parts = [
        f"{k} {v / wall:.1%}" for k, v in sorted(summary["badput_s"].items(), key=lambda kv: -kv[1]) if v > 0
    ]
    hours = f"{wall / 3600:.2f} h" if wall >= 3600 else f"{wall:.0f} s"
    return (
        f"goodput {summary['goodput']:.1%} of {hours} ({summary['attempts']} attempts); "
        f"badput: {', '.join(parts) or 'none'}"
    )


class Goodput:
    """This attempt's ledger. ``started``: the attempt's start (wall clock, ``time.time()``)."""

    def __init__(self, run_dir: Path, started: float, *, primary: bool, clock=time.time):
        self.run_dir, self.primary, self.clock = Path(run_dir), primary, clock
        self.before = attempts(self.run_dir)
        self.record: dict[str, Any] = {
            "started": started, "ended": started, "first_step": None, "last_step": None,
            "productive_s": 0.0, "badput_s": dict.fromkeys(KINDS, 0.0), "saved": {},
        }  # fmt: skip
        self.base = 0.0  # the run's net productive time before this attempt
        self.mark = started  # the end of the last accounted interval
        self.inside = 0.0  # badput measured since the mark
        self.written = started

    def resumed(self, from_step: int) -> Goodput:
        """The attempt starts after ``from_step`` (0: a new run): the gap since the last attempt
        and the earlier attempts' productive time after that step's save are badput."""
        self.record["first_step"] = from_step + 1
        if not self.before:
            return self
        net = totals(self.before)["productive_s"]
        lost = max(0.0, net - self._productive_at(from_step))
        self.record["badput_s"]["restart_gap"] = max(0.0, self.record["started"] - self.before[-1]["ended"])
        self.record["badput_s"]["lost"] = lost
        self.base = net - lost
        return self

    def _productive_at(self, step: int) -> float:
        """The run's net productive time when ``step`` was saved (0: not known, e.g. step 0)."""
        for attempt in [self.record, *reversed(self.before)]:
            if str(step) in attempt["saved"]:
                return attempt["saved"][str(step)]
        return 0.0

    def add(self, kind: str, seconds: float) -> None:
        """``seconds`` of badput ``kind`` measured inside the current interval."""
        self.record["badput_s"][kind] += seconds
        self.inside += seconds

    def start_loop(self) -> None:
        """The first step begins: everything so far (not measured as another kind) was startup."""
        self._close_interval("startup")

    def step(self, step: int, kind: str = "productive") -> None:
        """Step ``step`` finished: the interval since the last one, less what was measured inside
        it, is the step's (``productive``, ``skipped`` or ``rollback``)."""
        self._close_interval(kind)
        self.record["last_step"] = step
        if self.clock() - self.written > 30:
            self.write()

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was taken (after :meth:`step` of it): a restart or rollback to it
        loses what came after."""
        saved = self.record["saved"]
        saved[str(step)] = self.base + self.record["productive_s"]  # net, over every attempt
        for old in list(saved)[:-_KEEP_SAVES]:
            del saved[old]
        self.write()

    def rolled_back(self, to_step: int) -> None:
        """A rollback to ``to_step``: the productive time since its save is undone (``rollback``)."""
        undone = max(0.0, self.base + self.record["productive_s"] - self._productive_at(to_step))
        here = min(undone, self.record["productive_s"])  # the rest was an earlier attempt's: lost
        self.record["productive_s"] -= here
        self.record["badput_s"]["rollback"] += here
        self.record["badput_s"]["lost"] += undone - here
        self.base -= undone - here

    def finish(self, saved_step: int | None = None) -> dict[str, Any] | None:
        """The run has ended, ``saved_step`` saved (the final save and closing are ``checkpoint``);
        the totals over every attempt, written to ``<run>/goodput.json``."""
        self._close_interval("checkpoint")
        if saved_step is not None:
            self.saved(saved_step)
        self.write()
        return totals([*self.before, self.record])

    def _close_interval(self, kind: str) -> None:
        now = self.clock()
        rest = max(0.0, now - self.mark - self.inside)
        if kind == "productive":
            self.record["productive_s"] += rest
        else:
            self.record["badput_s"][kind] += rest
        self.mark, self.inside = now, 0.0
        self.record["ended"] = now

    def write(self) -> None:
        self.written = self.clock()
        if self.primary:
            write_atomic(
                self.run_dir / GOODPUT, json.dumps({"attempts": [*self.before, self.record]}), durable=False
            )
