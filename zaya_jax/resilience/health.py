"""Node health probes: a GPU, a network interface, the run directory's filesystem and the clocks
of the job's hosts, checked before the first step (preflight) and every
``resilience.health_every_s`` seconds in a thread off the step path. Each probe returns
:class:`Finding` records (``ok``, ``warn``, ``fail`` or ``skipped``); what the trainer does with a
failing one is ``resilience.on_unhealthy`` (``zaya_jax.train.health``).

- **gpu**: the first of ``amd-smi``, ``rocm-smi``, ``nvidia-smi`` on ``PATH``. Uncorrectable ECC
  errors, retired pages pending, XGMI errors fail; thermal throttling and PCIe replay / NAK counts
  that grew since the last probe warn. AMD's tools print JSON whose layout changes between ROCm
  releases, so their output is walked for the counters by name (a key that says ``uncorrectable``,
  ``xgmi`` + ``err``, ``pending``, ``replay`` / ``nak``, ``throttle``) rather than by position.
- **nic**: ``/sys/class/net`` (interfaces with a ``device``: physical ones) and
  ``/sys/class/infiniband`` (RDMA ports). An interface or port that was up at the first probe and
  is down now fails; carrier changes and RDMA link-downed / error counters that grew warn.
- **filesystem**: the run directory's free space against the next two checkpoints' size (fail: a
  drain saves one more; below one, the run stops without a save that could not be written
  whole), and the latency of a small durable write (warn above the limit; an error writing fails).
  The trainer also checks the free space on its main thread before every save.
- **clock**: every process's wall clock read right after a shared barrier; a spread above the limit
  fails (time-based saves and the supervisor's heartbeat compare clocks across hosts).

A tool that is missing, fails or prints something unreadable makes its probe ``skipped`` with one
line: a probe never ends a run by crashing. No library does this for JAX: MaxText's goodput and
Orbax's emergency checkpoints record and recover, they do not probe a node (docs/faults.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

Status = Literal["ok", "warn", "fail", "skipped"]
EXIT_DRAIN = 76  # an unhealthy node drained (resilience.on_unhealthy=drain): restart without it
EXIT_UNHEALTHY = 77  # an unhealthy node stopped the run (on_unhealthy=stop): a person decides
DRAIN_RECORD = "drain.json"  # <run>/drain.json: the nodes found unhealthy, for the supervisor


def node_name(env: dict[str, str] | None = None) -> str:
    """This host's name as the scheduler knows it (Slurm's node name, for ``--exclude``)."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class Finding:
    """One probe's verdict on one thing (a GPU, an interface, the filesystem)."""

    probe: str
    status: Status
    message: str
    node: str = dataclasses.field(default_factory=node_name)
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def line(self) -> str:
        return f"node {self.node}: {self.probe} probe: {self.message}"

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Finding:
        return cls(**record)


class UnhealthyNodeError(RuntimeError):
    """A failing probe with ``resilience.on_unhealthy`` stop, or at preflight: the run refuses to
    start (or stops) naming the node and the probe. ``drain``: the supervisor restarts without it."""

    def __init__(self, message: str, findings: Sequence[Finding], *, drain: bool):
        super().__init__(message)
        self.findings, self.drain = tuple(findings), drain

    @property
    def exit_code(self) -> int:
        return EXIT_DRAIN if self.drain else EXIT_UNHEALTHY


class Probe(Protocol):
    name: str

    def check(self) -> list[Finding]: ...


# ---------------------------------------------------------------------------------------------- gpu


def _number(value: Any) -> float | None:
    """A counter as printed: 3, "3", {"value": 3, "unit": ...}; None for "N/A" and the like."""
    if isinstance(value, dict) and "value" in value:
        value = value["value"]
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(str(value).strip().strip("[]"))
    except ValueError:
        return None


def _leaves(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every (key path, value) of a JSON tree; a ``{"value": ...}`` dict is one leaf."""
    if isinstance(tree, dict) and not (set(tree) <= {"value", "unit"} and "value" in tree):
        for key, value in tree.items():
            yield from _leaves(value, (*path, str(key).lower()))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _leaves(value, (*path, str(i)))
    else:
        yield path, tree


def _gpu_entries(tree: Any) -> list[tuple[str, Any]]:
    """(GPU label, its subtree): amd-smi's list of ``{"gpu": N, ...}``, rocm-smi's ``{"card0": ...}``."""
    if isinstance(tree, list):
        return [
            (f"GPU {e.get('gpu', i)}" if isinstance(e, dict) else f"GPU {i}", e) for i, e in enumerate(tree)
        ]
    if isinstance(tree, dict) and any(str(k).lower().startswith("card") for k in tree):
        return [(f"GPU {str(k)[4:]}", v) for k, v in tree.items() if str(k).lower().startswith("card")]
    return [("GPU", tree)]


_NO_ERROR = ("", "n/a", "no error", "none", "ok", "0")


def amd_problems(tree: Any, previous: dict[str, float]) -> tuple[list[tuple[Status, str]], dict[str, float]]:
    """The failures and warnings in one amd-smi / rocm-smi JSON output; the PCIe counters kept for
    the next probe (replay and NAK counts only warn when they grow)."""
    problems: list[tuple[Status, str]] = []
    counters: dict[str, float] = {}
    for gpu, entry in _gpu_entries(tree):
        totals, blocks, pending = 0.0, 0.0, set()
        for path, value in _leaves(entry):
            key, text, number = (path[-1] if path else ""), str(value).strip().lower(), _number(value)
            where = " ".join(path)
            if "uncorrectable" in key and number:
                totals += number if "total" in key else 0
                blocks += 0 if "total" in key else number
            elif (
                "pending" in path
                and path.index("pending") + 1 < len(path)
                and path[path.index("pending") + 1].isdigit()
            ):
                pending.add(path[: path.index("pending") + 2])
            elif key == "status" and text == "pending":
                pending.add(path[:-1])
            elif "xgmi" in where and "err" in key and text not in _NO_ERROR:
                problems.append(("fail", f"{gpu}: XGMI link error ({key} = {value})"))
            elif ("replay" in key or "nak" in key) and number is not None:
                name = f"{gpu} {'/'.join(path)}"
                counters[name] = number
                if number > previous.get(name, number):
                    problems.append(("warn", f"{gpu}: PCIe {key} grew by {number - previous[name]:g}"))
            elif "throttle" in where and any(w in text for w in ("thermal", "hw_slowdown", "prochot")):
                problems.append(("warn", f"{gpu}: throttling ({key} = {value})"))
        uncorrectable = totals or blocks  # the totals when printed, else the sum of the blocks
        if uncorrectable:
            problems.append(("fail", f"{gpu}: {uncorrectable:g} uncorrectable ECC errors"))
        if pending:
            problems.append(("fail", f"{gpu}: {len(pending)} retired pages pending"))
    return problems, counters


NVIDIA_FIELDS = (
    "index",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "clocks_throttle_reasons.hw_thermal_slowdown",
)


def nvidia_problems(text: str) -> list[tuple[Status, str]]:
    """The failures and warnings in ``nvidia-smi --query-gpu=NVIDIA_FIELDS --format=csv,noheader,nounits``."""
    problems: list[tuple[Status, str]] = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(NVIDIA_FIELDS):
            raise ValueError(f"expected {len(NVIDIA_FIELDS)} fields, got {line!r}")
        index, ecc, pending, thermal = cells
        if (_number(ecc) or 0) > 0:
            problems.append(("fail", f"GPU {index}: {_number(ecc):g} uncorrectable ECC errors"))
        if pending.lower() == "yes":
            problems.append(("fail", f"GPU {index}: retired pages pending"))
        if thermal.lower() == "active":
            problems.append(("warn", f"GPU {index}: hardware thermal slowdown"))
    return problems


class GpuProbe:
    """The node's GPUs through the first vendor tool found on ``path`` (default: ``PATH``)."""

    name = "gpu"
    COMMANDS: ClassVar[dict[str, list[list[str]]]] = {
        "amd-smi": [
            ["metric", "--ecc", "--pcie", "--xgmi-err", "--throttle", "--json"],
            ["bad-pages", "--json"],
        ],
        "rocm-smi": [["--showrasinfo", "all", "--showretiredpages", "--showpcie", "--json"]],
        "nvidia-smi": [[f"--query-gpu={','.join(NVIDIA_FIELDS)}", "--format=csv,noheader,nounits"]],
    }

    def __init__(self, path: str | None = None, timeout_s: float = 60.0):
        self.path, self.timeout_s = path, timeout_s
        self.counters: dict[str, dict[str, float]] = {}

    def _run(self, tool: str, args: list[str]) -> str:
        done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=self.timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"exit code {done.returncode}: {' '.join(done.stderr.split())[:200]}")
        return done.stdout

    def check(self) -> list[Finding]:
        tool = next((t for t in self.COMMANDS if shutil.which(t, path=self.path)), None)
        if tool is None:
            return [
                Finding(self.name, "skipped", "no amd-smi, rocm-smi or nvidia-smi on PATH: GPUs not probed")
            ]
        executable = shutil.which(tool, path=self.path)
        try:
            outputs = [self._run(executable, args) for args in self.COMMANDS[tool]]
            if tool == "nvidia-smi":
                problems = nvidia_problems(outputs[0])
            else:
                problems, counters = [], {}
                for i, output in enumerate(outputs):
                    found, kept = amd_problems(json.loads(output), self.counters.get(str(i), {}))
                    problems += found
                    counters[str(i)] = kept
                self.counters = counters
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
            return [
                Finding(
                    self.name, "skipped", f"{tool} could not be read ({' '.join(str(err).split())[:200]})"
                )
            ]
        if not problems:
            return [Finding(self.name, "ok", f"{tool}: no errors", detail={"tool": tool})]
        return [Finding(self.name, status, message, detail={"tool": tool}) for status, message in problems]


# ---------------------------------------------------------------------------------------------- nic


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


class NicProbe:
    """Network interfaces (``<sys>/class/net``, physical ones: those with a ``device``) and RDMA
    ports (``<sys>/class/infiniband/*/ports/*``). ``interfaces`` names the ones that must be up
    (empty: every physical interface and port up at the first probe)."""

    name = "nic"
    RDMA_ERRORS = ("link_downed", "symbol_error", "port_rcv_errors", "link_error_recovery")

    def __init__(self, sys_root: str | Path = "/sys", interfaces: Sequence[str] = ()):
        self.root, self.required = Path(sys_root) / "class", tuple(interfaces)
        self.watched: set[str] | None = None  # the links up at the first probe
        self.counters: dict[str, float] = {}

    def _links(self) -> dict[str, tuple[bool, dict[str, float]]]:
        """Every link: (up, its counters)."""
        links: dict[str, tuple[bool, dict[str, float]]] = {}
        net = self.root / "net"
        for iface in sorted(net.iterdir()) if net.is_dir() else []:
            if not (iface / "device").exists() and iface.name not in self.required:
                continue  # loopback, bridges, veths
            operstate, carrier = _read(iface / "operstate"), _read(iface / "carrier")
            changes = _number(_read(iface / "carrier_changes"))
            up = operstate == "up" and carrier != "0"
            links[iface.name] = (up, {"carrier_changes": changes} if changes is not None else {})
        rdma = self.root / "infiniband"
        for port in sorted(rdma.glob("*/ports/*")) if rdma.is_dir() else []:
            state = _read(port / "state") or ""
            counters = {c: _number(_read(port / "counters" / c)) for c in self.RDMA_ERRORS}
            name = f"{port.parents[1].name}/{port.name}"
            links[name] = ("ACTIVE" in state.upper(), {k: v for k, v in counters.items() if v is not None})
        return links

    def check(self) -> list[Finding]:
        links = self._links()
        if not links:
            return [
                Finding(self.name, "skipped", f"no network interface under {self.root}/net or /infiniband")
            ]
        if self.watched is None:
            self.watched = set(self.required) or {name for name, (up, _) in links.items() if up}
        findings = []
        for name in sorted(self.watched):
            up, counters = links.get(name, (False, {}))
            if not up:
                findings.append(Finding(self.name, "fail", f"{name} is down", detail={"link": name}))
            for counter, value in counters.items():
                key = f"{name}/{counter}"
                grew = value - self.counters.get(key, value)
                self.counters[key] = value
                if grew > 0:
                    findings.append(
                        Finding(
                            self.name, "warn", f"{name}: {counter} grew by {grew:g}", detail={"link": name}
                        )
                    )
        return findings or [Finding(self.name, "ok", f"{len(self.watched)} links up")]


# ---------------------------------------------------------------------------------------- filesystem


class FilesystemProbe:
    """A checkpoint directory's filesystem: room for the next checkpoints and the latency of a 64
    KiB durable write. ``checkpoint_bytes()``: one checkpoint's size; ``min_free_bytes``: a floor
    of the user's (``resilience.health_min_free_gb``).

    Free space below one checkpoint fails with ``detail["fits"] = False``: the next save would fail
    half written, so the run stops without it. Below two checkpoints (or the floor) it fails with
    ``fits = True``: the next save fits, the one after may not, so a drain saves now. A shared
    filesystem's state is not a node's (``detail["shared"]``): no other node fixes it; a node's
    own disk (``shared=False``, the local tier) is.
    :meth:`room` is the free-space half alone (one ``statfs``), for the main thread before a save.
    """

    name = "filesystem"

    def __init__(
        self,
        directory: str | Path,
        checkpoint_bytes: Callable[[], int],
        max_write_latency_s: float,
        min_free_bytes: int = 0,
        *,
        shared: bool = True,
    ):
        self.directory, self.checkpoint_bytes = Path(directory), checkpoint_bytes
        self.max_write_latency_s, self.min_free_bytes = max_write_latency_s, min_free_bytes
        self.shared = shared

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.directory).free

    def room(self) -> Finding | None:
        """A failing finding when the free space is short of the next checkpoints, else None."""
        try:
            free, needed = self.free_bytes(), self.checkpoint_bytes()
        except OSError as err:
            return Finding(self.name, "fail", f"cannot read {self.directory}: {err}")
        detail = {"free_bytes": free, "needed_bytes": needed, "shared": self.shared}
        have = f"{self.directory} has {free / 1e9:.2f} GB free"
        if free < needed:
            message = f"{have}, the next checkpoint needs about {needed / 1e9:.2f} GB: it would not fit"
            return Finding(self.name, "fail", message, detail={**detail, "fits": False})
        if free < max(2 * needed, self.min_free_bytes):
            message = (
                f"{have}: room for one more checkpoint of about {needed / 1e9:.2f} GB only "
                f"(resilience.health_min_free_gb={self.min_free_bytes / 1e9:g})"
            )
            return Finding(self.name, "fail", message, detail={**detail, "fits": True})
        return None

    def check(self) -> list[Finding]:
        short = self.room()
        if short is not None and "free_bytes" not in short.detail:
            return [short]  # the directory cannot be read
        findings = [short] if short is not None else []
        probe = self.directory / f".health-{os.getpid()}"
        start = time.perf_counter()
        try:
            with probe.open("wb") as f:
                f.write(os.urandom(1 << 16))
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as err:
            return [*findings, Finding(self.name, "fail", f"cannot write to {self.directory}: {err}")]
        latency = time.perf_counter() - start
        if latency > self.max_write_latency_s:
            message = (
                f"a 64 KiB durable write to {self.directory} took {latency:.1f} s "
                f"(resilience.health_max_write_latency_s={self.max_write_latency_s:g})"
            )
            findings.append(Finding(self.name, "warn", message, detail={"latency_s": latency}))
        if findings:
            return findings
        free, needed = self.free_bytes(), self.checkpoint_bytes()
        detail = {"free_bytes": free, "needed_bytes": needed}
        return [Finding(self.name, "ok", f"{free / 1e9:.1f} GB free", detail=detail)]


# --------------------------------------------------------------------------------------------- clock


class ClockProbe:
    """The spread of the processes' wall clocks, read right after a barrier (``gather(name,
    value)``: every process's value, in process order; None with one process). Preflight only: it
    is a collective exchange, so it runs on the main thread of every process."""

    name = "clock"

    def __init__(self, gather: Callable[[str, str], list[str] | None], max_skew_s: float):
        self.gather, self.max_skew_s = gather, max_skew_s

    def check(self) -> list[Finding]:
        if len(self.gather("clock_barrier", "") or []) < 2:
            return [Finding(self.name, "skipped", "one process: no clocks to compare")]
        clocks = [float(v) for v in self.gather("clock", repr(time.time())) or []]
        skew = max(clocks) - min(clocks)
        detail = {"skew_s": skew, "clocks": clocks}
        if skew > self.max_skew_s:
            slowest = clocks.index(min(clocks))
            message = (
                f"the processes' clocks differ by {skew:.1f} s (process {slowest} is behind; limit "
                f"resilience.health_max_clock_skew_s={self.max_skew_s:g}): synchronise them (chrony, NTP)"
            )
            return [Finding(self.name, "fail", message, detail=detail)]
        return [Finding(self.name, "ok", f"clocks within {skew:.3f} s", detail=detail)]


# ------------------------------------------------------------------------------------------- monitor


class HealthMonitor:
    """Runs ``probes`` every ``every_s`` seconds in a daemon thread. :meth:`take` hands over the
    findings not seen before (a warning, failure or skipped probe is reported once, until it clears); ``failing``
    is the first failure, kept: a node that failed once is not trusted again in this run."""

    def __init__(self, probes: Sequence[Probe], every_s: float):
        self.probes, self.every_s = list(probes), every_s
        self.failing: Finding | None = None
        self._new: list[Finding] = []
        self._seen: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self, probes: Sequence[Probe] | None = None) -> list[Finding]:
        """Run ``probes`` (default: all) now; every finding, also kept for :meth:`take`."""
        findings = []
        for probe in self.probes if probes is None else probes:
            try:
                findings += probe.check()
            except Exception as err:  # a probe never ends the run: it is skipped, saying why
                findings.append(Finding(probe.name, "skipped", f"probe failed: {type(err).__name__}: {err}"))
        self._keep(findings)
        return findings

    def _keep(self, findings: list[Finding]) -> None:
        current = {(f.probe, f.status, f.message) for f in findings if f.status != "ok"}
        with self._lock:
            self._new += [f for f in findings if (f.probe, f.status, f.message) in current - self._seen]
            probes = {f.probe for f in findings}
            self._seen = {key for key in self._seen if key[0] not in probes} | current
            if self.failing is None:
                self.failing = next((f for f in findings if f.status == "fail"), None)

    def take(self) -> list[Finding]:
        with self._lock:
            new, self._new = self._new, []
        return new

    def start(self) -> None:
        if self.every_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="zaya-health", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def close(self) -> None:
        self._stop.set()
