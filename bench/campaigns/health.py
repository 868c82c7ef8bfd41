"""The node-health fault campaign (bench/health_campaign.py): each fault injected into a run of two
processes (4 CPU devices each, one 8-device mesh), from outside, at a step the campaign chose by
watching ``metrics.jsonl``; then the same command again, as a supervisor or a requeue would.

Faults: a GPU reporting uncorrectable ECC errors (a fake ``amd-smi`` first on PATH, flipped by a
file), a NIC going down (``resilience.health_sys_root`` pointing at a fake ``/sys`` whose
interface's ``operstate`` the campaign sets to ``down``), the run directory's filesystem filling up
(a tmpfs filled with ``fallocate``, root only: to room for one and a half checkpoints, ``low``, or
half of one, ``full``), and a collective that never returns (process 1
stopped with SIGSTOP: process 0 waits in the step's collectives); a SIGKILL of both processes while
local-tier saves are written every step, and a node lost with its local tier (SIGKILL, then process
1's local directory deleted). For each: the action the trainer
took, the seconds from injection to that action, the steps lost (the last step reached before the
action minus the step the next launch resumed from; 0 where the action saved), whether anything was
silent (an action without its event or line), and the goodput of the run over both launches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.campaigns import MINI

FAKE_AMD_SMI = """#!/bin/sh
errors=0
if [ -e "$ZAYA_FAKE_SMI/ecc-all" ]; then errors=2; fi
case "$1" in
  metric) echo '[{"gpu": 0, "ecc": {"total_uncorrectable_count": 0}}, {"gpu": 1, "ecc": {"total_uncorrectable_count": '$errors'}}]';;
  bad-pages) echo '[]';;
esac
"""


@dataclasses.dataclass
class Trial:
    fault: str
    action: str = ""
    seconds_to_action: float | None = None
    injected_after_step: int | None = None
    last_step: int | None = None
    resumed_from: int | None = None
    silent: bool = True
    goodput: float | None = None
    note: str = ""

    @property
    def steps_lost(self) -> int | None:
        if self.last_step is None or self.resumed_from is None:
            return None
        return max(0, self.last_step - self.resumed_from)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    run: Path, steps: int, extra: list[str], env: dict[str, str], processes: int = 2
) -> list[subprocess.Popen]:
    """The run's processes (2 of 4 CPU devices, or 1 of 8): one 8-device mesh either way."""
    port = _port()
    env = {**os.environ, **env, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={8 // processes}"
    args = [
        *MINI, f"run.dir={run}", f"train.steps={steps}", "train.batch_size=8", "log.every=1",
        "eval.every=1000", "eval.at_start=false", "checkpoint.every_steps=10", "mesh.data=2",
        "mesh.fsdp=2", "mesh.expert=2", "train.dispatch_ahead=false", *extra,
    ]  # fmt: skip
    procs = []
    for i in range(processes):
        command = [sys.executable, "-m", "zaya_jax.cli", "train", *args, "--no-progress"]
        if processes > 1:
            command += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)]
            command += ["--process-id", str(i)]
        procs.append(
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        )
    return procs


def _last_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if '"loss"' in line]
    return max(steps, default=0)


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _wait_step(run: Path, step: int, procs: list[subprocess.Popen], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while _last_step(run) < step:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"the run did not reach step {step}: {procs[0].communicate()[1][-2000:]}")
        time.sleep(0.05)


def _ended(
    procs: list[subprocess.Popen], timeout: float = 600, on_first=None
) -> tuple[list[int], float, str]:
    """Exit codes, when the first process ended (wall clock; ``on_first()`` then), process 0's stderr."""
    deadline, first = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        if first is None and any(p.poll() is not None for p in procs):
            first = time.time()
            if on_first is not None:
                on_first()
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
        time.sleep(0.02)
    first = first or time.time()
    return [p.returncode for p in procs], first, procs[0].communicate()[1]


def run_trial(fault: str, root: Path, steps: int, inject_after: int, every_s: float) -> Trial:
    trial, run = Trial(fault), root / fault / "run"
    run.parent.mkdir(parents=True, exist_ok=True)
    env: dict[str, str] = {}
    extra = [f"resilience.health_every_s={every_s}"]
    if fault == "gpu_ecc":
        fake = run.parent / "smi"
        (fake / "bin").mkdir(parents=True)
        (fake / "bin" / "amd-smi").write_text(FAKE_AMD_SMI)
        (fake / "bin" / "amd-smi").chmod(0o755)
        env = {"PATH": f"{fake / 'bin'}:{os.environ['PATH']}", "ZAYA_FAKE_SMI": str(fake)}
    elif fault == "nic_down":
        iface = run.parent / "sys" / "class" / "net" / "eth9"
        (iface / "device").mkdir(parents=True)
        (iface / "operstate").write_text("up\n")
        (iface / "carrier").write_text("1\n")
        extra += [f"resilience.health_sys_root={run.parent / 'sys'}"]
    elif fault.startswith("filesystem_"):
        if os.geteuid() != 0 or shutil.which("mount") is None:
            trial.note = "not run: needs root to mount a tmpfs"
            return trial
        mount = run.parent / "tmpfs"
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mount)], check=True)
        run = mount / "run"
    elif fault == "collective_hang":
        extra += ["runtime.collective_timeout_s=10", "resilience.hang_timeout_s=600"]
    elif fault in ("local_save_killed", "node_lost"):
        extra += [f"checkpoint.local_dir={run.parent / 'ramdisk'}", "checkpoint.local_every_steps=1"]
        return _kill_local(trial, fault, run, steps, inject_after, extra)
    try:
        return _inject(trial, fault, run, steps, inject_after, extra, env)
    finally:
        if fault.startswith("filesystem_"):
            subprocess.run(["umount", "-l", str(run.parent)], check=False)


def _inject(
    trial: Trial, fault: str, run: Path, steps: int, after: int, extra: list[str], env: dict
) -> Trial:
    procs = _launch(run, steps, extra, env)
    _wait_step(run, after, procs)
    trial.injected_after_step = _last_step(run)
    injected = time.time()
    if fault == "gpu_ecc":
        (Path(env["ZAYA_FAKE_SMI"]) / "ecc-all").write_text("")
    elif fault == "nic_down":
        sys_root = Path(extra[-1].split("=", 1)[1])
        (sys_root / "class" / "net" / "eth9" / "operstate").write_text("down\n")
    elif fault.startswith("filesystem_"):  # low: room for the drain's save; full: for none
        (check,) = [e for e in _events(run) if e["event"] == "health_check"]
        (disk,) = [f for f in check["detail"]["findings"] if f["probe"] == "filesystem" and f["process"] == 0]
        keep = int((1.5 if fault == "filesystem_low" else 0.5) * disk["detail"]["needed_bytes"])
        filler = max(0, shutil.disk_usage(run).free - keep)
        subprocess.run(["fallocate", "-l", str(filler), str(run / "filler")], check=True)
    elif fault == "collective_hang":
        procs[1].send_signal(signal.SIGSTOP)
    codes, ended, err = _ended(
        procs, on_first=lambda: procs[1].kill() if fault == "collective_hang" else None
    )
    trial.last_step = _last_step(run)
    events = _events(run)
    acted = [e for e in events if e["event"] in ("health", "collective_timeout")]
    drain = json.loads((run / "drain.json").read_text()) if (run / "drain.json").is_file() else {}
    trial.action = {
        76: "drain: saved, exit 76",
        75: "exit 75: restart from the last checkpoint",
        77: f"{'drain: saved' if drain.get('saved') else 'stop, nothing saved'}: exit 77",
    }.get(codes[0], f"exit codes {codes}")
    trial.seconds_to_action = ended - injected
    trial.silent = not acted or ("zaya train: fail" not in err and "collective_timeout" not in err)
    if fault.startswith("filesystem_"):
        (run / "filler").unlink()
    if fault == "gpu_ecc":
        (Path(env["ZAYA_FAKE_SMI"]) / "ecc-all").unlink()
    elif fault == "nic_down":
        (Path(extra[-1].split("=", 1)[1]) / "class" / "net" / "eth9" / "operstate").write_text("up\n")
    clean = [x for x in extra if not x.startswith("runtime.collective_timeout_s")]
    again = _launch(run, steps, clean, env)
    codes, _, err = _ended(again)
    if codes != [0, 0]:
        trial.note = f"the second launch ended {codes}: {err[-300:]}"
        return trial
    resumes = [e["detail"]["from_step"] for e in _events(run) if e["event"] == "resume"]
    trial.resumed_from = resumes[-1] if resumes else 0
    trial.goodput = json.loads((run / "summary.json").read_text())["goodput"]["goodput"]
    return trial


def _kill_local(trial: Trial, fault: str, run: Path, steps: int, after: int, extra: list[str]) -> Trial:
    """Two processes saving their local tiers every step, both SIGKILLed after step ``after`` (the
    job killed mid-save); for ``node_lost`` process 1's local directory (its node's RAM disk) is
    deleted before the restart, so no local step is held by every process."""
    procs = _launch(run, steps, extra, {})
    _wait_step(run, after, procs)
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()
    trial.injected_after_step = trial.last_step = _last_step(run)
    trial.action = "SIGKILL: the restart restores the newest local step both processes hold"
    if fault == "node_lost":
        for lost in (run.parent / "ramdisk").glob("*/process_1-of-2"):
            shutil.rmtree(lost)
        trial.action = "SIGKILL, process 1's local tier deleted: the restart restores the persistent tier"
    started = time.time()
    codes, _, err = _ended(_launch(run, steps, extra, {}))
    if codes != [0, 0]:
        trial.note = f"the restart ended {codes}: {err[-300:]}"
        return trial
    resume = [e for e in _events(run) if e["event"] == "resume"][-1]
    trial.resumed_from = resume["detail"]["from_step"]
    trial.action += f" (it restored step {trial.resumed_from} of the {resume['detail']['tier']} tier)"
    trial.seconds_to_action = resume["time"] - started  # the restart's restore, from its launch
    trial.silent = False
    trial.goodput = json.loads((run / "summary.json").read_text())["goodput"]["goodput"]
    return trial


def table(trials: list[Trial], every_s: float) -> str:
    lines = [
        "| fault | action | s from injection to action | injected after step | steps lost | silent | goodput over both launches |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in trials:
        if t.note.startswith("not run"):
            lines.append(f"| {t.fault} | {t.note} | | | | | |")
            continue
        secs = f"{t.seconds_to_action:.1f}" if t.seconds_to_action is not None else "-"
        good = f"{t.goodput:.1%}" if t.goodput is not None else "-"
        lines.append(
            f"| {t.fault} | {t.action} | {secs} | {t.injected_after_step} | {t.steps_lost} | "
            f"{'yes' if t.silent else 'no'} | {good} |"
        )
    lines.append(f"\n(probes every {every_s:g} s: resilience.health_every_s)")
    return "\n".join(lines)
