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


def _probes(cfg: Config, run_path: Path, state_bytes: int) -> tuple[list[Probe], ClockProbe | None]:
    """The local probes (checked by the thread) and the clock comparison (at the start only)."""
    res = cfg.resilience
    needed = int(res.health_min_free_gb * 1e9) or 2 * state_bytes
    made: dict[str, Probe] = {
        "gpu": GpuProbe(),
        "nic": NicProbe(res.health_sys_root, interfaces=res.health_interfaces),
        "filesystem": FilesystemProbe(run_path, lambda: needed, res.health_max_write_latency_s),
    }
    clock = None
    if "clock" in res.health_probes:
        timeout = cfg.runtime.barrier_timeout_s
        clock = ClockProbe(
            lambda name, value: gather_strings(name, value, timeout), res.health_max_clock_skew_s
        )
    return [made[name] for name in res.health_probes if name in made], clock


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

    def __init__(self, cfg: Config, run_path: Path, monitor: HealthMonitor):
        self.cfg, self.run_path, self.monitor = cfg, run_path, monitor
        self.primary = jax.process_index() == 0
        self.drained: tuple[list[Finding], int] | None = None

    @classmethod
    def start(cls, cfg: Config, run_path: Path, abstract_state: Any) -> NodeHealth:
        """Probe every process before the first step; raise :class:`UnhealthyNodeError` when one
        fails (unless ``on_unhealthy: warn``); then start the thread."""
        local, clock = _probes(cfg, run_path, state_bytes(abstract_state))
        health = cls(cfg, run_path, HealthMonitor(local, cfg.resilience.health_every_s))
        checked = health.monitor.check([*local, *([clock] if clock else [])])
        health.monitor.take()  # reported here, not again at the first step
        found = gather_findings(checked, cfg.runtime.barrier_timeout_s)
        health.report(found, None, at="preflight")
        failing = [f for _, f in found if f.status == "fail"]
        if failing and cfg.resilience.on_unhealthy != "warn":
            health.refuse(failing, None, at="preflight")
        health.monitor.start()
        return health

    def pending(self) -> list[dict[str, Any]]:
        """This process's findings since the last step, for the step's agreement."""
        return [f.record() for f in self.monitor.take()]

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
        self, failing: Sequence[Finding], step: int | None, *, at: str, found_at: int | None = None
    ) -> None:
        """Record the failing nodes for the supervisor and raise :class:`UnhealthyNodeError`."""
        policy = self.cfg.resilience.on_unhealthy
        drain = policy == "drain"
        if self.primary:
            record = {
                "time": time.time(), "step": step, "found_at_step": found_at or step, "at": at, "policy": policy,
                "findings": [f.record() for f in failing],
            }  # fmt: skip
            write_atomic(self.run_path / DRAIN_RECORD, json.dumps(record, indent=1))
        nodes = sorted({f.node for f in failing})
        when = (
            "refusing to start" if step is None else f"{'saved step ' if drain else 'stopped at step '}{step}"
        )
        action = (
            "restart without it (zaya supervise excludes it)"
            if drain
            else "exit (resilience.on_unhealthy=stop)"
        )
        message = f"{failing[0].line}; {when}: node {', '.join(nodes)} is unhealthy, {action}"
        raise UnhealthyNodeError(message, failing, drain=drain)

    def act(self, agreed: Sequence[tuple[int, dict[str, Any]]], step: int) -> str | None:
        """The agreed findings of ``step``: each reported; a failure drains (returns ``"drain"``: the
        loop stops after this step, saving it), stops (raises) or is only reported (``warn``)."""
        found = [(process, Finding.from_record(record)) for process, record in agreed]
        self.report(found, step, at="step")
        failing = [f for _, f in found if f.status == "fail"]
        if not failing or self.cfg.resilience.on_unhealthy == "warn":
            return None
        if self.cfg.resilience.on_unhealthy == "stop":
            self.refuse(failing, step, at="step")
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
