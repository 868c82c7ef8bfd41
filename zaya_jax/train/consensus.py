"""Decisions every process must take together, agreed once per step.

Orbax's save begins with a barrier that is a device collective, so a save that one process starts
and another does not deadlocks both; the same holds for stopping. Each process therefore only
*proposes*: "a time-based save is due by my clock", "I received SIGTERM/SIGINT", "my step outcome
says accept/skip/rollback/stop", "my save in flight has finished its writes". One gather of these
four integers per step (through the coordination service's key-value store, host to host: the next
step is already running on the devices, and a device collective would queue behind it) makes every
process act on the same combined value: a save is taken when any clock says it is due, a stop
when any process was signalled, the save in flight is committed now when every process has
written its part (so no process waits at Orbax's commit barrier for another's writes); the outcome
must already agree (it comes from replicated values), and a disagreement is an error rather than a
hang.

Why not Orbax's ``save_decision_policy`` and ``reached_preemption``: ``ContinuousCheckpointingPolicy``
(the primary's clock, broadcast) skips a due save while the previous one is still being written and
takes whole seconds; ``reached_preemption`` needs JAX's preemption notifier, which exists only under
``jax.distributed``, reacts to SIGTERM only (not SIGINT / Ctrl-C) and is replaced by any Python
SIGTERM handler. The stop flag has to be combined anyway, so one gather carries all four. With one
process the agreement is the local value and costs nothing. Step-count saves
(``checkpoint.every_steps``) and retention (``checkpoint.keep*``, Orbax's preservation policies) are
pure functions of the step and replicated metrics, so they agree by construction.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from zaya_jax.parallel.distributed import gather_strings
from zaya_jax.train.decisions import Action

_ACTIONS = list(Action)


class ProcessesDisagreeError(RuntimeError):
    """Processes computed different outcomes for the same step (a bug or silent data corruption)."""


@dataclasses.dataclass(frozen=True)
class Agreed:
    """What every process does after this step."""

    time_save: bool  # a time-based save is due (by the clock of at least one process)
    stop: str | None  # the signal (SIGTERM before SIGINT) received by at least one process
    stopped_by: tuple[int, ...] = ()  # the processes that received it
    save_written: bool = False  # the save in flight has finished its writes on every process
    health: tuple[tuple[int, dict[str, Any]], ...] = ()  # (process, health finding) since the last step


def agree(
    step: int,
    *,
    time_due: bool,
    stop: str | None,
    action: Action,
    written: bool = False,
    health: Sequence[dict[str, Any]] = (),
    timeout_s: float = 3600.0,
) -> Agreed:
    """Combine this process's proposals with every other process's (every process must call it
    once per finished step). ``health``: this process's new health findings (records), handed to
    every process (with a device gather, which carries integers only, each keeps its own). The exchange goes through the coordination service, not the devices:
    with the next step already dispatched, a device collective would wait for that step to end."""
    signum = int(signal.Signals[stop]) if stop else 0
    mine = np.asarray([int(time_due), signum, _ACTIONS.index(action), int(written)], np.int32)
    text = ",".join(map(str, mine.tolist())) + "|" + json.dumps(list(health))
    gathered = gather_strings("agree", text, timeout_s)
    if gathered is not None:
        rows = [row.split("|", 1) for row in gathered]
        table = np.asarray([[int(x) for x in ints.split(",")] for ints, _ in rows], np.int32)
        found = tuple((i, f) for i, (_, found) in enumerate(rows) for f in json.loads(found))
    else:  # pragma: no cover - no coordination service: a device gather
        table = np.asarray(multihost_utils.process_allgather(mine))
        found = tuple((jax.process_index(), f) for f in health)
    actions = set(table[:, 2].tolist())
    if len(actions) > 1:
        per_process = {i: _ACTIONS[int(a)].value for i, a in enumerate(table[:, 2])}
        raise ProcessesDisagreeError(
            f"step {step}: the processes reached different outcomes {per_process}; their losses should be "
            "identical (replicated). Check that every process runs the same code and config"
        )
    received = table[:, 1]
    combined = int(received.max())
    return Agreed(
        time_save=bool(table[:, 0].max()),
        stop=signal.Signals(combined).name if combined else None,
        stopped_by=tuple(int(i) for i in np.flatnonzero(received)),
        save_written=bool(table[:, 3].min()),
        health=found,
    )


class StopRequest:
    """SIGTERM/SIGINT handling: a signal asks the loop to save a checkpoint and exit. ``requested``
    is this process's own request; the loop stops on the one agreed by all processes."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
