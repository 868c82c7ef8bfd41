"""A seeded, randomized SIGKILL fault campaign against ``zaya train``, ``zaya data prepare`` and
``zaya convert`` (both directions); shared by ``bench/fault_campaign.py`` (the full campaign) and
``tests/resilience/test_campaign.py`` (a short CI subset).

Every command runs as a child process (``python -m zaya_jax.cli ...``) and is killed with SIGKILL at a
moment drawn from a seeded generator (:class:`Kill`): an *anchor* (an event the process reaches) plus
a *delay*, a fraction ``u`` in [0, 1) of how long the uninterrupted reference run took from that
anchor to the next one. Anchors make the kills land inside the work rather than in the interpreter's
start-up: for ``zaya train`` the process start (``step`` 0) or the first heartbeat of *this* process
with ``step >= s`` (1 <= s <= steps; the window is the reference's time from beat ``s`` to beat
``s + 1``, or to the process exit after the last step, which covers the final evaluation and save);
for ``zaya data prepare`` and ``zaya convert`` the process start or the first new entry in the
output's parent directory (the window runs until the output appeared under its own name in the
reference, plus 10%: the writing, the rename and the clean-up after it). The same seed draws the same kills (``plan_*``); where they
land also depends on the machine's timing, which is recorded for every kill (:class:`Landing`).

**Train** (``train_trial``): one uninterrupted reference run keeping every checkpoint, then trials,
each a fresh run directory, killed ``kills_per_trial`` times (each time rerunning the same command,
which resumes), then rerun until it exits 0. Checked per trial:

- the final variables (parameters and balancing state, every leaf ``np.array_equal``, dtype
  included) equal the reference's ("bit-identical");
- ``metrics.jsonl`` logs every step exactly once (``log.every=1``);
- **no committed step is lost**. Right after each kill (the process is dead, so the directory is
  frozen) the committed steps are the numeric directories in ``checkpoints/`` (Orbax commits a step
  by renaming ``<step>.orbax-checkpoint-tmp-*`` to ``<step>``; retention deletes old ones).
  Let ``latest`` be the largest. The kill *lost* a committed step when ``latest`` cannot be
  restored (``zaya_jax.checkpoint.restore_model``), when its parameters differ from the reference's
  at that step, or when the next process that resumes resumes from an earlier step (its ``resume``
  event's ``from_step < latest``: the trainer found ``latest`` unreadable). Older committed steps
  are not required to survive: retention (``checkpoint.keep``) deletes them by design once newer
  ones are committed, and a kill in the middle of that deletion may leave one half-deleted
  (counted as ``cleanup_interrupted``); the guarantee is that the newest committed step, the one a
  resume needs, is intact. Steps that had not committed when the process died (a ``*-tmp-*``
  directory) were never promised and are redone by the resume.

**Prepare** (``prepare_trial``) and **convert** (``convert_trial``): one uninterrupted reference
output, then per trial a fresh destination, killed once at a drawn moment, then the same command
rerun to completion. Right after the kill the destination must be absent (or empty) or already
complete and identical to the reference (it is never half-written under its own name); the rerun
must exit 0, give a result identical to the reference and leave nothing else in the parent
directory (no staging directory or lock file). "Identical" is byte for byte for prepared shards
and HF exports (every file name and byte); for ``hf-to-zaya`` it is the same ``config.yaml`` bytes
(but for the run's own path, ``run.dir``) and the same arrays bit for bit, because Orbax's own
files are never byte-identical between two writes (random file names, timestamps).
"""

from __future__ import annotations

import dataclasses
import filecmp
import itertools
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bench import campaigns

CLI = [sys.executable, "-m", "zaya_jax.cli"]
# the campaigns' miniature model, with every step logged and no periodic evaluation
MINI = [*campaigns.MINI, "log.every=1", "eval.every=100"]
POLL_S = 0.004
CHILD_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------------------
# Killing a child at a moment


@dataclasses.dataclass(frozen=True)
class Kill:
    """Where a kill is aimed: ``anchor`` (train: 0 = process start, s = first heartbeat of step
    >= s; prepare/convert: 0 = process start, 1 = first new entry in the output's parent) and the
    fraction ``u`` of the reference's window after that anchor."""

    anchor: int
    u: float


@dataclasses.dataclass
class Outcome:
    pid: int
    killed: bool  # False: the process had exited before the moment came
    returncode: int
    stderr: str
    seconds: float  # from the start to the kill or exit
    anchor_at: float | None  # when the anchor was reached (seconds from the start)


def run_child(
    cmd: list[str],
    *,
    anchor: Callable[[subprocess.Popen], bool] | None = None,
    delay: float = 0.0,
    timeout: float = CHILD_TIMEOUT_S,
) -> Outcome:
    """Run ``cmd``; with ``anchor``, SIGKILL it ``delay`` seconds after ``anchor(proc)`` first holds
    (never, if it exits first). stderr goes through a file (no pipe to fill)."""
    with tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        anchor_at, killed = None, False
        try:
            if anchor is not None:
                while proc.poll() is None and not anchor(proc) and time.monotonic() - start < timeout:
                    time.sleep(POLL_S)
                if proc.poll() is None:
                    anchor_at = time.monotonic() - start
                    fire = time.monotonic() + delay
                    while proc.poll() is None and time.monotonic() < fire:
                        time.sleep(min(POLL_S, max(0.0, fire - time.monotonic())))
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    killed = True
            returncode = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            returncode = proc.wait()
        seconds = time.monotonic() - start
        err.seek(0)
        return Outcome(proc.pid, killed, returncode, err.read(), seconds, anchor_at)


def new_entry_in(parent: Path) -> Callable[[subprocess.Popen], bool]:
    """An anchor: something new appeared in ``parent`` (the output, its staging directory or lock)."""
    before = set(os.listdir(parent))
    return lambda proc: bool(set(os.listdir(parent)) - before)


# ---------------------------------------------------------------------------------------------
# Tallies


@dataclasses.dataclass
class Tally:
    """One row of the campaign table."""

    target: str
    trials: int = 0
    faults: int = 0  # SIGKILLs delivered to a live process
    missed: int = 0  # drawn moments that came after the process had exited (no fault)
    reruns: int = 0  # processes started after a kill (resumes / reruns)
    identical: int = 0  # trials whose final result equals the reference
    lost: int = 0  # committed checkpoints lost (train) / half-written outputs under the final name
    landed: Counter = dataclasses.field(default_factory=Counter)  # where the kills landed
    notes: Counter = dataclasses.field(default_factory=Counter)  # other observations
    failures: list[str] = dataclasses.field(default_factory=list)

    def fail(self, message: str) -> None:
        self.failures.append(message)

    @property
    def ok(self) -> bool:
        return not self.failures and self.lost == 0 and self.identical == self.trials


def table(tallies: list[Tally]) -> str:
    """The campaign table (markdown) and where the kills landed."""
    lines = [
        "| target | trials | faults injected (SIGKILL) | resumes / reruns | bit-identical results | "
        "checkpoints lost / half-written outputs | failed checks |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in tallies:
        lines.append(
            f"| {t.target} | {t.trials} | {t.faults} | {t.reruns} | {t.identical} / {t.trials} | "
            f"{t.lost} | {len(t.failures)} |"
        )
    lines += ["", "Where the kills landed (and other observations):", ""]
    for t in tallies:
        where = "; ".join(f"{k}: {v}" for k, v in t.landed.most_common())
        extra = [f"{k}: {v}" for k, v in t.notes.most_common()]
        if t.missed:
            extra.append(f"drawn moments after the process had already finished: {t.missed}")
        lines.append(f"- {t.target}: {where or 'no kill'}" + (f" ({'; '.join(extra)})" if extra else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Train


def train_cmd(run: Path, steps: int, every: int, keep: int) -> list[str]:
    return [
        *CLI,
        "train",
        *MINI,
        f"train.steps={steps}",
        f"checkpoint.every_steps={every}",
        f"checkpoint.keep={keep}",
        "checkpoint.async_save=true",
        f"run.dir={run}",
        "--no-progress",
    ]


def _heartbeat(run: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run / "heartbeat.json").read_text())
    except (OSError, ValueError):
        return None


def heartbeat_at(run: Path, step: int) -> Callable[[subprocess.Popen], bool]:
    """An anchor: this process's heartbeat has reached ``step`` (0: the process start)."""

    def reached(proc: subprocess.Popen) -> bool:
        if step == 0:
            return True
        beat = _heartbeat(run)
        return beat is not None and beat.get("pid") == proc.pid and beat.get("step", -1) >= step

    return reached


def committed_steps(run: Path) -> list[int]:
    directory = run / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def restore_variables(step_dir: Path) -> dict[str, Any]:
    """Parameters and balancing state of a checkpoint, as NumPy arrays."""
    from zaya_jax.checkpoint import restore_model

    _, variables, _ = restore_model(step_dir)
    return jax.tree.map(np.asarray, variables)


def same_variables(a: dict[str, Any], b: dict[str, Any]) -> bool:
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    return tree_a == tree_b and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True)
    )


@dataclasses.dataclass
class TrainReference:
    run: Path
    steps: int
    every: int
    keep: int
    windows: list[float]  # [start -> beat 1, beat 1 -> beat 2, ..., beat N -> exit], seconds
    _variables: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def command(self, run: Path) -> list[str]:
        return train_cmd(run, self.steps, self.every, self.keep)

    def variables(self, step: int) -> dict[str, Any]:
        """The reference's variables at ``step`` (restored once, when first asked for)."""
        if step not in self._variables:
            self._variables[step] = restore_variables(self.run / "checkpoints" / str(step))
        return self._variables[step]

    def delay(self, kill: Kill) -> float:
        return kill.u * self.windows[kill.anchor]


def train_reference(
    root: Path, steps: int = 12, every: int = 1, keep: int = 2, warmup: bool = False
) -> TrainReference:
    """The uninterrupted run (the trials' command, but keeping every checkpoint for the per-step
    comparison) and its timeline of heartbeats. ``warmup``: run it once before, so that the timed
    run (and the start-up window) finds every program in the compilation cache, as the trials do."""
    if warmup:
        outcome = run_child(train_cmd(root / "warmup", steps, every, keep))
        if outcome.returncode != 0:
            raise RuntimeError(f"the warm-up run failed ({outcome.returncode}):\n{outcome.stderr[-3000:]}")
        shutil.rmtree(root / "warmup")
    run = root / "reference"
    beats: dict[int, float] = {}
    start = time.monotonic()

    def watch(proc: subprocess.Popen) -> bool:
        beat = _heartbeat(run)
        if beat is not None and beat.get("pid") == proc.pid and beat.get("phase") == "step":
            beats.setdefault(int(beat["step"]), time.monotonic() - start)
        return False  # never fires: the reference is not killed

    outcome = run_child(train_cmd(run, steps, every, steps + 1), anchor=watch)
    if outcome.returncode != 0:
        raise RuntimeError(f"the reference run failed ({outcome.returncode}):\n{outcome.stderr[-3000:]}")
    times = [0.0] + [beats.get(s, np.nan) for s in range(1, steps + 1)] + [outcome.seconds]
    for i in range(len(times) - 2, 0, -1):  # a beat the poller missed: the time of the next one
        if not np.isfinite(times[i]):
            times[i] = times[i + 1]
    windows = [max(0.01, b - a) for a, b in itertools.pairwise(times)]
    return TrainReference(run, steps, every, keep, windows)


def plan_train(seed: int, steps: int) -> Iterator[Kill]:
    """The seeded sequence of moments: anchor uniform over the process start and steps 1..steps,
    then u. Trials take from it until enough kills have hit a live process."""
    rng = random.Random(f"{seed}-train")
    while True:
        yield Kill(rng.randrange(steps + 1), rng.random())


def _train_landing(run: Path, pid: int, steps: int) -> str:
    """Where a kill landed, from this process's last heartbeat and the frozen checkpoints/."""
    beat = _heartbeat(run)
    if beat is None or beat.get("pid") != pid:
        return "start-up, before the first heartbeat"
    step, phase = int(beat.get("step", 0)), beat.get("phase")
    if step == 0:
        return f"start-up ({phase})"
    if step >= steps:
        return "after the last step (final eval, save, exit)"
    ckpts = run / "checkpoints"
    if any(".orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir()):
        return "steps, with an async save being written"
    return "steps, no save being written"


def _events(run: Path) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _restorable(run: Path, step: int) -> bool:
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # a half-deleted step makes Orbax warn about every missing file
    try:
        restore_variables(run / "checkpoints" / str(step))
    except Exception:
        return False
    finally:
        absl.setLevel(level)
    return True


def train_trial(ref: TrainReference, run: Path, kills: list[Kill], tally: Tally, max_reruns: int = 5) -> None:
    """One fresh run killed at each of ``kills`` in turn (every kill after the first hits a rerun of
    the same command, which resumes), then rerun until it exits 0; checks as in the module doc."""
    tally.trials += 1
    cmd = ref.command(run)
    expectations: list[tuple[int, int, str]] = []  # (events before the resume, latest committed, kill)
    for i, kill in enumerate(kills):
        what = f"{run.name} kill {i + 1} ({kill})"
        if i > 0:
            tally.reruns += 1
        outcome = run_child(cmd, anchor=heartbeat_at(run, kill.anchor), delay=ref.delay(kill))
        if not outcome.killed:
            tally.missed += 1
            if outcome.returncode != 0:
                tally.fail(f"{what}: exited {outcome.returncode} on its own:\n{outcome.stderr[-3000:]}")
                return
            break
        tally.faults += 1
        tally.landed[_train_landing(run, outcome.pid, ref.steps)] += 1
        steps = committed_steps(run)
        if not steps:
            continue
        latest = max(steps)
        check_latest(ref, run, latest, tally, what)
        if any(not _restorable(run, s) for s in steps if s != latest):
            tally.notes["kills that interrupted a retention deletion (an older step half-deleted)"] += 1
        expectations.append((len(_events(run)), latest, what))
    else:
        for attempt in range(max_reruns):
            tally.reruns += 1
            outcome = run_child(cmd)
            if outcome.returncode == 0:
                break
            tally.fail(
                f"{run.name}: resume {attempt + 1} exited {outcome.returncode}:\n{outcome.stderr[-3000:]}"
            )
        else:
            return
    _check_finished_run(ref, run, expectations, tally)


def check_latest(ref: TrainReference, run: Path, latest: int, tally: Tally, what: str) -> None:
    try:
        variables = restore_variables(run / "checkpoints" / str(latest))
    except Exception as err:
        tally.lost += 1
        tally.fail(
            f"{what}: the latest committed step {latest} cannot be restored: {type(err).__name__}: {err}"
        )
        return
    if not same_variables(variables, ref.variables(latest)):
        tally.lost += 1
        tally.fail(f"{what}: committed step {latest} differs from the reference's step {latest}")


def _check_finished_run(
    ref: TrainReference, run: Path, expectations: list[tuple[int, int, str]], tally: Tally
) -> None:
    name = run.name
    events = _events(run)
    for seen, latest, what in expectations:
        resumes = [e for e in events[seen:] if e["event"] == "resume"]
        if resumes and resumes[0]["detail"]["from_step"] < latest:
            tally.lost += 1
            tally.fail(
                f"{what}: step {latest} was committed when it was killed, but the next resume started "
                f"from step {resumes[0]['detail']['from_step']}"
            )
    unreadable = sum(e["event"] == "checkpoint_unreadable" for e in events)
    if unreadable:
        tally.notes["checkpoint_unreadable events"] += unreadable
    metrics = run / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [line["step"] for line in lines if "loss" in line]
    if steps != list(range(1, ref.steps + 1)):
        tally.fail(f"{name}: metrics.jsonl logs the steps {steps}, not 1..{ref.steps} once each in order")
    try:
        final = restore_variables(run / "checkpoints" / str(ref.steps))
    except Exception as err:
        tally.fail(f"{name}: the final step {ref.steps} cannot be restored: {type(err).__name__}: {err}")
        return
    if same_variables(final, ref.variables(ref.steps)):
        tally.identical += 1
    else:
        tally.fail(f"{name}: the final parameters differ from the reference's")
    if any(".orbax-checkpoint-tmp" in p.name for p in (run / "checkpoints").iterdir()):
        tally.notes["finished runs still holding a stale *.orbax-checkpoint-tmp* directory"] += 1
    if not (run / "summary.json").is_file():
        tally.notes["finished runs without summary.json"] += 1


# ---------------------------------------------------------------------------------------------
# Prepare and convert: outputs that must appear whole


@dataclasses.dataclass
class OutputReference:
    """An uninterrupted run of a command that writes one directory ``path``; ``windows`` = [start
    -> first new entry in the parent, that -> the output's appearance under its name, plus 10%] in
    seconds; ``same(a, b)`` compares outputs."""

    command: Callable[[Path], list[str]]
    path: Path
    windows: list[float]
    same: Callable[[Path, Path], bool]
    check_complete: Callable[[Path], None] | None = None  # raises when an output is not usable

    def delay(self, kill: Kill) -> float:
        return kill.u * self.windows[kill.anchor]


def output_reference(
    command: Callable[[Path], list[str]],
    out: Path,
    same: Callable[[Path, Path], bool],
    check_complete: Callable[[Path], None] | None = None,
    warmup: bool = False,
) -> OutputReference:
    """The uninterrupted run and its timeline (``warmup``: after one run to warm the page and
    compilation caches, as the trials find them)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if warmup:
        scratch = out.parent / "warmup"
        scratch.mkdir()
        if run_child(command(scratch / out.name)).returncode != 0:
            raise RuntimeError(f"the warm-up run of {command(out)} failed")
        shutil.rmtree(scratch)
    appeared = new_entry_in(out.parent)
    first: list[float] = []
    published: list[float] = []
    start = time.monotonic()

    def watch(proc: subprocess.Popen) -> bool:
        now = time.monotonic() - start
        if not first and appeared(proc):
            first.append(now)
        if not published and out.exists():
            published.append(now)
        return False

    outcome = run_child(command(out), anchor=watch)
    if outcome.returncode != 0:
        raise RuntimeError(f"the reference {command(out)} failed:\n{outcome.stderr[-3000:]}")
    begin = first[0] if first else outcome.seconds
    end = published[0] if published else outcome.seconds
    # the writing, and a tenth more: the rename, removing the lock, the start of the exit
    return OutputReference(command, out, [begin, max(0.01, 1.1 * (end - begin))], same, check_complete)


def plan_output(seed: int, target: str) -> Iterator[Kill]:
    """The seeded sequence of moments: 85% after the output's first file appears (the writing),
    15% from the process start (imports, reading the inputs)."""
    rng = random.Random(f"{seed}-{target}")
    while True:
        yield Kill(1 if rng.random() < 0.85 else 0, rng.random())


def _output_anchor(parent: Path, kill: Kill) -> Callable[[subprocess.Popen], bool]:
    return new_entry_in(parent) if kill.anchor == 1 else (lambda proc: True)


def output_trial(ref: OutputReference, parent: Path, kill: Kill, tally: Tally) -> None:
    """A fresh destination ``parent/out``: the command killed once at ``kill``, then rerun."""
    tally.trials += 1
    parent.mkdir(parents=True, exist_ok=True)
    out = parent / ref.path.name
    cmd = ref.command(out)
    what = f"{parent.name} ({kill})"
    outcome = run_child(cmd, anchor=_output_anchor(parent, kill), delay=ref.delay(kill))
    if not outcome.killed:
        tally.missed += 1
        if outcome.returncode != 0:
            tally.fail(f"{what}: exited {outcome.returncode} on its own:\n{outcome.stderr[-3000:]}")
            return
    else:
        tally.faults += 1
        staging = parent / f".{out.name}.partial"  # zaya_jax.staging's name for it
        if out.exists() and os.listdir(out):
            if ref.same(out, ref.path):
                tally.landed["after the output was complete (in place, identical)"] += 1
            else:
                tally.lost += 1
                tally.fail(f"{what}: {out} is left half-written: {sorted(os.listdir(out))}")
        elif staging.exists():
            tally.landed["while the staging directory was being written"] += 1
            if ref.check_complete is not None:  # the unfinished output is refused by its readers
                try:
                    ref.check_complete(staging)
                except Exception:
                    pass
                else:
                    tally.notes["kills after the staging directory was complete, before its rename"] += 1
        elif os.listdir(parent):
            tally.landed["after the lock, before the staging directory"] += 1
        else:
            tally.landed["before anything was written"] += 1
        tally.reruns += 1
        outcome = run_child(cmd)
        if outcome.returncode != 0:
            tally.fail(f"{what}: the rerun exited {outcome.returncode}:\n{outcome.stderr[-3000:]}")
            return
    if ref.check_complete is not None:
        try:
            ref.check_complete(out)
        except Exception as err:
            tally.fail(f"{what}: the output is not usable: {type(err).__name__}: {err}")
            return
    if ref.same(out, ref.path):
        tally.identical += 1
    else:
        tally.fail(f"{what}: the output differs from the uninterrupted one")
    leftovers = sorted(set(os.listdir(parent)) - {out.name})
    if leftovers:
        tally.fail(f"{what}: left behind next to the output: {leftovers}")


def same_files(a: Path, b: Path) -> bool:
    """Two directory trees hold the same names with the same bytes."""
    names_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*"))
    names_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*"))
    return names_a == names_b and all(
        (a / n).is_dir() == (b / n).is_dir()
        and ((a / n).is_dir() or filecmp.cmp(a / n, b / n, shallow=False))
        for n in names_a
    )


def write_corpus(path: Path, documents: int, seed: int = 0) -> Path:
    """A JSONL corpus of ``documents`` pseudo-random documents (50-1,000 bytes of words)."""
    rng = np.random.default_rng(seed)
    words = np.array(["zaya", "expert", "router", "token", "shard", "kill", "resume", "ünïcode", "the", "a"])
    with path.open("w") as f:
        for i in range(documents):
            text = " ".join(words[rng.integers(0, len(words), rng.integers(10, 160))])
            f.write(json.dumps({"text": f"{i}: {text}"}) + "\n")
    return path


def prepare_reference(root: Path, corpus: Path, shards: int = 4, warmup: bool = False) -> OutputReference:
    from zaya_jax.data import open_prepared

    def command(out: Path) -> list[str]:
        return [*CLI, "data", "prepare", str(corpus), "--out", str(out), "--shards", str(shards)]

    return output_reference(command, root / "reference" / "prepared", same_files, open_prepared, warmup)


MINI_MODEL = campaigns.MINI_MODEL
# 26M parameters (100 MB of float32): big enough that writing it takes a while to be killed in
LARGER_MODEL = [
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=64",
    "model.num_experts=8",
    "model.moe_intermediate_size=1024",
    "model.router_hidden_size=64",
]


def make_hf_source(path: Path, model: list[str] = MINI_MODEL, seed: int = 0) -> Path:
    """An HF ``save_pretrained`` directory of the ``tiny`` preset with the ``model`` overrides and
    random weights, written in process."""
    from zaya_jax.config import load_config
    from zaya_jax.interop.hf import save_hf_directory
    from zaya_jax.model import init_variables

    cfg = load_config("tiny", model).model
    save_hf_directory(path, cfg, init_variables(cfg, seed))
    return path


def same_converted_run(a: Path, b: Path) -> bool:
    """Two ``hf-to-zaya`` outputs hold the same thing: the same entries and committed steps, the same
    config.yaml bytes but for the run's own path, and bit-identical arrays (Orbax's files differ
    between any two writes)."""
    if sorted(os.listdir(a)) != sorted(os.listdir(b)) or committed_steps(a) != committed_steps(b):
        return False
    # config.yaml names the run's own directory (run.dir), which is all that may differ
    if (a / "config.yaml").read_text().replace(str(a), "<dst>") != (b / "config.yaml").read_text().replace(
        str(b), "<dst>"
    ):
        return False
    try:
        return same_variables(restore_variables(a), restore_variables(b))
    except Exception:
        return False


def _loadable(path: Path) -> None:
    import zaya_jax

    zaya_jax.load(path)


def convert_references(
    root: Path, hf_source: Path, warmup: bool = False
) -> tuple[OutputReference, OutputReference]:
    """(hf-to-zaya from ``hf_source``, zaya-to-hf from that reference's output)."""

    def to_zaya(out: Path) -> list[str]:
        return [*CLI, "convert", "hf-to-zaya", str(hf_source), str(out)]

    to_zaya_ref = output_reference(
        to_zaya, root / "reference-hf-to-zaya" / "zaya", same_converted_run, _loadable, warmup
    )

    def to_hf(out: Path) -> list[str]:
        return [*CLI, "convert", "zaya-to-hf", str(to_zaya_ref.path), str(out)]

    to_hf_ref = output_reference(to_hf, root / "reference-zaya-to-hf" / "hf", same_files, _loadable, warmup)
    return to_zaya_ref, to_hf_ref


# ---------------------------------------------------------------------------------------------
# The campaign


def run_campaign(
    root: Path,
    *,
    seed: int,
    train_kills: int,
    kills_per_trial: int = 1,
    prepare_kills: int,
    convert_kills: int,
    steps: int = 12,
    every: int = 1,
    keep: int = 2,
    corpus_documents: int = 20_000,
    convert_model: list[str] = MINI_MODEL,
    warmup: bool = False,
    parallel: bool = False,
    keep_outputs: bool = False,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> list[Tally]:
    """The whole campaign under ``root``: ``train_kills`` SIGKILLs of zaya train (``kills_per_trial``
    per run), ``prepare_kills`` of zaya data prepare and ``convert_kills`` of zaya convert each way.
    Each target takes moments from its seeded sequence until that many kills have hit a live process
    (a moment that comes after the process has finished counts as missed, and the next is drawn; at
    most twice the number asked for plus 5 are drawn). With ``parallel``, train runs beside the rest
    (two children at a time). A trial's directory is removed once it passed, unless
    ``keep_outputs``. Returns one :class:`Tally` per target."""
    train = Tally("zaya train")
    prepare = Tally("zaya data prepare")
    to_zaya = Tally("zaya convert hf-to-zaya")
    to_hf = Tally("zaya convert zaya-to-hf")

    def tidy(path: Path, tally: Tally, failures_before: int) -> None:
        if not keep_outputs and len(tally.failures) == failures_before:
            shutil.rmtree(path, ignore_errors=True)

    def draws_left(tally: Tally, wanted: int, trials: int) -> bool:
        return tally.faults < wanted and max(tally.faults + tally.missed, trials) < 2 * wanted + 5

    def train_part() -> None:
        ref = train_reference(root / "train", steps, every, keep, warmup)
        log(f"train: reference done, windows (s) {[round(w, 2) for w in ref.windows]}")
        plan = plan_train(seed, steps)
        t = 0
        while draws_left(train, train_kills, t):
            run = root / "train" / f"trial-{t:03d}"
            before = len(train.failures)
            kills = list(itertools.islice(plan, min(kills_per_trial, train_kills - train.faults)))
            _guarded(train, run.name, train_trial, ref, run, kills, train)
            log(f"train: {run.name} {kills} -> {_status(train, before)}")
            tidy(run, train, before)
            t += 1

    def outputs(ref: OutputReference, tally: Tally, name: str, wanted: int, directory: Path) -> None:
        plan = plan_output(seed, name)
        t = 0
        while draws_left(tally, wanted, t):
            parent = directory / f"{name}-trial-{t:03d}"
            kill = next(plan)
            before = len(tally.failures)
            _guarded(tally, parent.name, output_trial, ref, parent, kill, tally)
            log(f"{name}: {parent.name} {kill} -> {_status(tally, before)}")
            tidy(parent, tally, before)
            t += 1

    def output_part() -> None:
        if prepare_kills:
            corpus = write_corpus((root / "corpus.jsonl"), corpus_documents, seed)
            ref = prepare_reference(root / "prepare", corpus, warmup=warmup)
            log(f"prepare: reference done, windows (s) {[round(w, 2) for w in ref.windows]}")
            outputs(ref, prepare, "prepare", prepare_kills, root / "prepare")
        if convert_kills:
            source = make_hf_source(root / "hf-source", convert_model)
            refs = convert_references(root / "convert", source, warmup)
            log(f"convert: references done, windows (s) {[[round(w, 2) for w in r.windows] for r in refs]}")
            outputs(refs[0], to_zaya, "hf-to-zaya", convert_kills, root / "convert")
            outputs(refs[1], to_hf, "zaya-to-hf", convert_kills, root / "convert")

    parts = [p for p, n in ((train_part, train_kills), (output_part, prepare_kills + convert_kills)) if n]
    if parallel and len(parts) > 1:
        errors: list[BaseException] = []

        def run(part: Callable[[], None]) -> None:
            try:
                part()
            except BaseException as err:  # re-raised below, in the caller's thread
                errors.append(err)

        threads = [threading.Thread(target=run, args=(part,)) for part in parts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    else:
        for part in parts:
            part()
    wanted = (
        (train, train_kills),
        (prepare, prepare_kills),
        (to_zaya, convert_kills),
        (to_hf, convert_kills),
    )
    for tally, n in wanted:
        if n and tally.faults < n:
            tally.fail(f"only {tally.faults} of the {n} kills asked for hit a live process")
    return [t for t, n in wanted if n]


def _guarded(tally: Tally, name: str, trial: Callable[..., None], *args: Any) -> None:
    try:
        trial(*args)
    except Exception as err:  # a trial that crashed the harness is a failed check, not an abort
        tally.fail(f"{name}: {type(err).__name__}: {err}")


def _status(tally: Tally, failures_before: int) -> str:
    new = tally.failures[failures_before:]
    return "ok" if not new else "FAILED: " + " | ".join(f.splitlines()[0] for f in new)
