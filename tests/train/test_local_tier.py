"""The local checkpoint tier (``checkpoint.local_dir``): saved on its own cadence beside the
persistent tier; after a crash the run resumes from the freshest step whose arrays verify, local or
persistent; a local tier lost with its node, or damaged, costs only the steps since the last
persistent save."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.fixtures import MINI
from tests.resilience.faults import corrupt_checkpoint
from zaya_jax.checkpoint.local import local_tier
from zaya_jax.cli import main
from zaya_jax.train.hooks import Hook


class Crash(Hook):
    """Raises after step ``at`` (a process that dies there; in process, so the test stays fast)."""

    def __init__(self, at: int):
        self.at = at

    def after_step(self, end):
        if end.step == self.at:
            raise KeyboardInterrupt(f"crashed after step {end.step}")


def _args(run: Path, local: Path) -> list[str]:
    return [
        "train", *MINI, f"run.dir={run}", "train.steps=8", "eval.every=100", "checkpoint.every_steps=4",
        f"checkpoint.local_dir={local}", "checkpoint.local_every_steps=1", "checkpoint.local_keep=2",
        "checkpoint.async_save=false", "--no-progress",
    ]  # fmt: skip


def _resumed_from(run: Path) -> int:
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [e["detail"]["from_step"] for e in events if e["event"] == "resume"][-1]


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_restarts_take_the_freshest_verified_tier(tmp_path):
    run, local = tmp_path / "run", tmp_path / "ramdisk"
    tier = local_tier(str(local), run)

    def crash_after(step: int) -> None:
        with pytest.raises(KeyboardInterrupt):
            main(_args(run, local), hooks=[Crash(step)])

    crash_after(5)
    assert _steps(run / "checkpoints") == [4] and _steps(tier) == [3, 5]  # 4: persistent only; keep 2
    crash_after(6)
    assert _resumed_from(run) == 5  # local 5 is fresher than persistent 4
    assert _steps(tier) == [5, 6]
    corrupt_checkpoint(tier / "6")
    crash_after(7)
    assert _resumed_from(run) == 5  # local 6 fails its fingerprints (quarantined); local 5 beats 4
    assert (tier.parent / "quarantine").is_dir()
    shutil.rmtree(local)  # the node is lost with its RAM disk
    assert main(_args(run, local)) == 0
    assert _resumed_from(run) == 4  # only the steps since the last persistent save are lost
    assert json.loads((run / "summary.json").read_text())["steps"] == 8
