"""A run's node health (``resilience.health_*``, probes in :mod:`zaya_jax.resilience.health`).

Before anything is compiled every process runs its probes and the clock comparison; the findings
are gathered (host to host, through the coordination service), process 0 records each as a
``health`` event and one line, and a failure anywhere refuses the start on every process (except
with ``on_unhealthy: warn``), naming node and probe: a healthy peer waiting at a collective for a
process that stopped alone would hang. During the run a daemon thread probes every
``health_every_s``; its new findings ride on the step's agreement (:func:`zaya_jax.train.consensus.agree`),
so every process acts on a failure at the same step: ``drain`` saves that step and exits 76,
``stop`` exits 77 at once. Process 0 writes ``<run>/drain.json`` (the nodes and why) for
``zaya supervise``, which excludes them from the restart (or the Slurm requeue).

Before each step that may save, every process also checks its checkpoint tiers' free space on the
main thread (the thread's last probe can be a minute old). A save that would not fit is never
started (it would fail half written): the run stops at that step, its last checkpoint standing.
Room for one more checkpoint only drains (that save fits). A shared filesystem short of space
exits 77, not 76: no other node fixes it, a person frees space.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zaya_jax.config import Config
from zaya_jax.files import append_event, write_atomic
from zaya_jax.parallel.distributed import gather_strings
from zaya_jax.resilience.health import (
    DRAIN_RECORD,
    ClockProbe,
    FilesystemProbe,
    Finding,
    GpuProbe,
    HealthMonitor,
    NicProbe,
    Probe,
    UnhealthyNodeError,
)

SAVE_MARGIN_BYTES = 1 << 20  # a checkpoint's own files beside its arrays (MINI: 49 files, 0.34 MB)


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (a local tier's directory is made at its first save)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _probes(
    cfg: Config, run_path: Path, state_bytes: int
) -> tuple[list[Probe], ClockProbe | None, list[FilesystemProbe]]:
    """The local probes (checked by the thread), the clock comparison (at the start only) and the
    checkpoint tiers' filesystems (checked before each save too)."""
    res = cfg.resilience
    checkpoint = state_bytes + SAVE_MARGIN_BYTES
    floor, latency = int(res.health_min_free_gb * 1e9), res.health_max_write_latency_s
    rooms = [FilesystemProbe(run_path, lambda: checkpoint, latency, floor)]
    if cfg.checkpoint.local_dir:  # a node's own disk: another node fixes it
        local = _existing(Path(cfg.checkpoint.local_dir))
        rooms.append(FilesystemProbe(local, lambda: checkpoint, latency, floor, shared=False))
    made: dict[str, list[Probe]] = {
        "gpu": [GpuProbe()],
        "nic": [NicProbe(res.health_sys_root, interfaces=res.health_interfaces)],
        "filesystem": list(rooms),
    }
    clock = None
    if "clock" in res.health_probes:
        timeout = cfg.runtime.barrier_timeout_s
        clock = ClockProbe(
            lambda name, value: gather_strings(name, value, timeout), res.health_max_clock_skew_s
        )
    probes = [probe for name in res.health_probes for probe in made.get(name, [])]
    return probes, clock, rooms if "filesystem" in res.health_probes else []


def state_bytes(abstract_state: Any) -> int:
    """The bytes a checkpoint of the whole train state holds (every process's shards)."""
    leaves = jax.tree.leaves(abstract_state)
    return int(sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in leaves))


def gather_findings(findings: Sequence[Finding], timeout_s: float) -> list[tuple[int, Finding]]:
    """Every process's ``findings``, as (process, finding)."""
    mine = json.dumps([f.record() for f in findings])
    rows = gather_strings("health", mine, timeout_s) or [mine]
    return [(i, Finding.from_record(r)) for i, row in enumerate(rows) for r in json.loads(row)]


class NodeHealth:
    """The run's probes: the preflight (:meth:`start`), the thread, and the findings each step
    carries to the agreement (:meth:`pending`)."""

    def __init__(
        self, cfg: Config, run_path: Path, monitor: HealthMonitor, rooms: Sequence[FilesystemProbe] = ()
    ):
        self.cfg, self.run_path, self.monitor, self.rooms = cfg, run_path, monitor, list(rooms)
        self.primary = jax.process_index() == 0
        self.drained: tuple[list[Finding], int] | None = None
        self._short: set[tuple[str, bool]] = set()  # (directory, fits) already reported before a save

    @classmethod
    def start(cls, cfg: Config, run_path: Path, abstract_state: Any) -> NodeHealth:
        """Probe every process before the first step; raise :class:`UnhealthyNodeError` when one
        fails (unless ``on_unhealthy: warn``); then start the thread."""
        local, clock, rooms = _probes(cfg, run_path, state_bytes(abstract_state))
        health = cls(cfg, run_path, HealthMonitor(local, cfg.resilience.health_every_s), rooms)
        checked = health.monitor.check([*local, *([clock] if clock else [])])
        health.monitor.take()  # reported here, not again at the first step
        found = gather_findings(checked, cfg.runtime.barrier_timeout_s)
        health.report(found, None, at="preflight")
        failing = [f for _, f in found if f.status == "fail"]
        if failing and cfg.resilience.on_unhealthy != "warn":
            health.refuse(failing, None, at="preflight")
        health.monitor.start()
        return health

    def pending(self, save_due: bool = False) -> list[dict[str, Any]]:
        """This process's findings since the last step, for the step's agreement; with
        ``save_due``, each checkpoint tier's free space too (on this thread, one ``statfs`` each:
        a save the thread has not yet found short of room would fail half written)."""
        found = self.monitor.take()
        for probe in self.rooms if save_due else ():
            short = probe.room()
            key = (str(probe.directory), bool(short and short.detail.get("fits")))
            if short is not None and key not in self._short:
                self._short.add(key)
                found.append(short)
        return [f.record() for f in found]

    def report(self, found: Sequence[tuple[int, Finding]], step: int | None, *, at: str) -> None:
        """By process 0: the preflight as one ``health_check`` event (every finding, ``ok`` ones
        too), a finding during the run as a ``health`` event; each one not ``ok`` also as a line (a
        probe skipped on a CPU run, e.g. no GPU tool on a laptop, only in the event)."""
        if not self.primary:
            return
        records = [{**finding.record(), "process": process} for process, finding in found]
        if at == "preflight":
            append_event(self.run_path, "health_check", None, {"findings": records})
        else:
            for record in records:
                append_event(self.run_path, "health", step, record)
        quiet = jax.default_backend() == "cpu"
        for _, finding in found:
            if (
                finding.status == "warn"
                or finding.status == "fail"
                or (finding.status == "skipped" and not quiet)
            ):
                print(f"zaya train: {finding.status}: {finding.line}", file=sys.stderr, flush=True)

    def refuse(
        self,
        failing: Sequence[Finding],
        step: int | None,
        *,
        at: str,
        found_at: int | None = None,
        saved: bool = True,
    ) -> None:
        """Record the failing nodes for the supervisor and raise :class:`UnhealthyNodeError`:
        exit 76 (drain: restart without them) when a node is at fault, 77 when a person must act
        (``stop``, or only a shared filesystem short of space: no other node fixes that)."""
        policy = self.cfg.resilience.on_unhealthy
        node_fault = any(not f.detail.get("shared") for f in failing)
        drain = policy == "drain" and node_fault
        if self.primary:
            record = {
                "time": time.time(), "step": step, "found_at_step": found_at or step, "at": at, "policy": policy,
                "saved": saved and policy == "drain" and step is not None, "findings": [f.record() for f in failing],
            }  # fmt: skip
            write_atomic(self.run_path / DRAIN_RECORD, json.dumps(record, indent=1))
        nodes = sorted({f.node for f in failing})
        if step is None:
            when = "refusing to start"
        elif policy == "drain" and saved:
            when = f"saved step {step}"
        else:
            when = f"stopped at step {step}" + ("" if saved else " without saving it")
        if drain:
            action = f"node {', '.join(nodes)} is unhealthy, restart without it (zaya supervise excludes it)"
        elif policy == "stop":
            action = f"node {', '.join(nodes)} is unhealthy, exit (resilience.on_unhealthy=stop)"
        else:
            action = "free space there (or move run.dir) and restart: no other node fixes it"
        raise UnhealthyNodeError(f"{failing[0].line}; {when}: {action}", failing, drain=drain)

    def act(self, agreed: Sequence[tuple[int, dict[str, Any]]], step: int) -> str | None:
        """The agreed findings of ``step``: each reported; a failure drains (returns ``"drain"``: the
        loop stops after this step, saving it), stops (raises) or is only reported (``warn``)."""
        found = [(process, Finding.from_record(record)) for process, record in agreed]
        self.report(found, step, at="step")
        failing = [f for _, f in found if f.status == "fail"]
        if not failing or self.cfg.resilience.on_unhealthy == "warn":
            return None
        unsaved = any(f.detail.get("fits") is False for f in failing)  # the save would not fit
        if self.cfg.resilience.on_unhealthy == "stop" or unsaved:
            self.refuse(failing, step, at="step", saved=False)
        self.drained = (failing, step)
        return "drain"

    def after_run(self, saved_step: int) -> None:
        """After the run closed, its last step (``saved_step``: the agreed step, or the one after
        it with dispatch ahead) saved: exit as a drain (code 76)."""
        if self.drained is not None:
            failing, found_at = self.drained
            self.refuse(failing, saved_step, at="step", found_at=found_at)

    def close(self) -> None:
        self.monitor.close()
