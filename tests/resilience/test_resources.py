"""Resource faults on a real (small) file system: a disk that fills up during training and a run
directory that turns read-only. Each ends with one clear line naming the path and the fix, and
every checkpoint committed before stays restorable; once space is freed the same command resumes.

The file system is a size-limited tmpfs mounted for the test (CI runs as root); where mounting is
not permitted the test is skipped with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import MINI
from zaya_jax.checkpoint import restore_model

CLI = [sys.executable, "-m", "zaya_jax.cli"]


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _remount(mount: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)


def _train(run: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    args = [
        *MINI,
        f"train.steps={steps}",
        "checkpoint.every_steps=1",
        "checkpoint.keep=100",
        "log.every=1",
        *extra,
    ]
    cmd = [*CLI, "train", *args, f"run.dir={run}", "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _zaya_lines(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if line.startswith("zaya train: "))


def _committed(run: Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def test_full_disk_then_read_only_run_directory(small_fs):
    run = small_fs / "run"
    # 2 MB hold a few checkpoints of ~0.6 MB. Without the filesystem probe, which would stop the run
    # before a save that cannot fit (tests/train/test_health.py), the save itself fails mid-write.
    full = _train(run, 24, "resilience.health_probes=[gpu,nic,clock]")
    assert full.returncode == 1, full.stderr[-3000:]
    said = _zaya_lines(full.stderr)
    found = "No space left on device" in said and str(run) in said and "rerun the same command" in said
    assert found, full.stderr[-4000:]  # all of stderr: the failure may not be a `zaya train:` line
    committed = _committed(run)
    assert committed, "nothing was committed before the disk filled"
    for step in committed:  # every committed checkpoint is intact
        assert restore_model(run / "checkpoints" / str(step))[2] == step

    _remount(small_fs, "size=64m")  # space freed: the same command resumes and finishes
    resumed = _train(run, 24)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f'"from_step": {committed[-1]}' in (run / "events.jsonl").read_text()
    assert _committed(run)[-1] == 24

    _remount(small_fs, "ro")  # a read-only run directory: refused with the fix, still evaluable
    refused = _train(run, 30)
    assert refused.returncode == 1
    said = _zaya_lines(refused.stderr)
    found = "Read-only file system" in said and str(run) in said and "remount it read-write" in said
    assert found, refused.stderr[-4000:]
    evaluated = subprocess.run(
        [*CLI, "eval", str(run), "--json"], capture_output=True, text=True, timeout=600
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert restore_model(run)[2] == 24
