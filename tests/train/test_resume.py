"""Nothing is lost: SIGTERM saves a checkpoint and exits cleanly; a save failing in the background
stops the run and the rerun resumes from the last complete one; resuming with another model is
refused. (A run killed with SIGKILL resumes bit-identical: tests/train/test_stages.py, across a
curriculum boundary, the first kill during a background save.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures import MINI

STEPS = 8
COMMON = [
    *MINI,
    f"train.steps={STEPS}",
    "log.every=1",
    "eval.every=100",
    "checkpoint.every_steps=2",
]


def _train(
    run: Path,
    *extra: str,
    check: bool = True,
    prefix: tuple[str, ...] = (sys.executable, "-m", "zaya_jax.cli"),
) -> subprocess.CompletedProcess:
    cmd = [*prefix, "train", *COMMON, f"run.dir={run}", *extra, "--no-progress"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "loss" in line]
    assert len(steps) == len(set(steps)), "a resumed run must not log a step twice"
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "zaya_jax.cli", "train", *MINI, f"run.dir={run}", "train.steps=100000"]
    proc = subprocess.Popen(
        [*cmd, "log.every=1", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.time() + 300
    while time.time() < deadline and not (
        (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = json.loads(out.decode()[out.decode().index("{") :])
    assert summary["interrupted"] and summary["steps"] >= 3
    assert (run / "checkpoints" / str(summary["steps"]) / "train").is_dir()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert events[-2]["event"] == "stop" and events[-2]["detail"]["signal"] == "SIGTERM"


@pytest.mark.parametrize("model_change", ["model.num_experts=3"])
def test_resuming_with_another_model_is_refused(tmp_path, model_change):
    run = tmp_path / "run"
    _train(run, "train.steps=2")
    result = _train(run, model_change, check=False)
    assert result.returncode == 2 and "different model config" in result.stderr
    assert os.path.isdir(run / "checkpoints" / "2")


@pytest.mark.parametrize("ahead", [False, True])
def test_time_based_checkpoints_and_keep_policy(tmp_path, ahead):
    from zaya_jax.config import load_config
    from zaya_jax.train.loop import train

    run = tmp_path / "run"
    overrides = [
        *MINI,
        f"run.dir={run}",
        "train.steps=5",
        "checkpoint.every_minutes=1e-9",
        "checkpoint.keep=3",
        f"train.dispatch_ahead={ahead}",
    ]
    train(load_config("tiny", overrides), progress=False)
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    if not ahead:
        assert steps == [3, 4, 5]  # a save after every step (the interval is tiny), the last three kept
    else:  # a save agreed at a step the next one was dispatched past is taken at that next step:
        # step 1's at 2, step 3 (evaluated: finished before dispatching on) its own, step 4's at 5
        assert steps == [2, 3, 5]


def test_restarting_a_finished_run_changes_nothing(tmp_path):
    from zaya_jax.config import load_config
    from zaya_jax.train.loop import train

    cfg = load_config("tiny", [*MINI, f"run.dir={tmp_path / 'run'}", "train.steps=2"])
    first = train(cfg, progress=False)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    summary = (tmp_path / "run" / "summary.json").read_text()
    again = train(cfg, progress=False)
    assert again == first  # no step ran: the run's own summary, not one of nulls written over it
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    assert (tmp_path / "run" / "summary.json").read_text() == summary


def test_a_save_failing_in_the_background_stops_the_run_and_loses_nothing(tmp_path, monkeypatch, capsys):
    """An async save that fails (here: ENOSPC while writing step 4's data item) is raised, naming the
    step and the complete checkpoints; rerunning resumes from the last complete one and finishes."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    from zaya_jax.cli import main

    handler = json_checkpoint_handler.JsonCheckpointHandler
    original = handler._save_fn

    async def failing_save(self, item, directory):
        name, step = Path(directory).name, Path(directory).parent.name  # e.g. data.orbax-...-tmp, 4.orbax-...
        if name.split(".")[0] == "data" and step.split(".")[0] == "4":
            raise OSError(28, "No space left on device")
        return await original(self, item, directory)

    run = tmp_path / "run"
    argv = ["train", *COMMON, f"run.dir={run}", "--no-progress"]
    monkeypatch.setattr(handler, "_save_fn", failing_save)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "saving the checkpoint of step 4" in err and "No space left on device" in err
    assert "resume from step 2" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    assert max(_losses(run)) < STEPS  # the run stopped instead of carrying on without checkpoints

    monkeypatch.setattr(handler, "_save_fn", original)
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == STEPS and not summary["interrupted"]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert next(e for e in events if e["event"] == "resume")["detail"]["from_step"] == 2
