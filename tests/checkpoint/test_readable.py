"""One loading path for checkpoints (zaya_jax/checkpoint/readable.py): every command that reads a
run falls back past a damaged latest step (set aside in ``quarantine/``, one warning line), stops
with one line naming an explicitly given damaged step and the fix, and says which steps it looked
at when none is left; a config that does not fit the schema and a permission error are not damage
(nothing is moved)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import zaya_jax
from bench.campaigns.damage_runner import RUN
from zaya_jax import checkpoint
from zaya_jax.cli import main
from zaya_jax.config import ConfigError


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("readable") / "run"
    assert main(["train", *RUN, f"run.dir={run}"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]
    return run


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(pristine, copy)
    return copy


def _quarantined(run: Path) -> list[str]:
    return (
        sorted(p.name.split("-")[0] for p in (run / "quarantine").iterdir())
        if (run / "quarantine").exists()
        else []
    )


def _stray_step(run: Path) -> None:
    (run / "checkpoints" / "9").mkdir()
    (run / "checkpoints" / "9" / "notes.txt").write_text("copied by hand\n")


DAMAGE = {
    "params missing": lambda run: shutil.rmtree(run / "checkpoints/4/params"),
    "balancing missing": lambda run: shutil.rmtree(run / "checkpoints/4/balancing"),
    "config item not JSON": lambda run: (run / "checkpoints/4/config/metadata").write_text("{\n  oops"),
    "Orbax's step record of the wrong shape": lambda run: (
        run / "checkpoints/4/_CHECKPOINT_METADATA"
    ).write_text(
        json.dumps(
            {**json.loads((run / "checkpoints/4/_CHECKPOINT_METADATA").read_text()), "metrics": [1, 2]}
        )
    ),
    "params data overwritten": lambda run: [
        p.write_bytes(b"\0" * p.stat().st_size) for p in (run / "checkpoints/4/params").rglob("d/*")
    ],
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_run_falls_back_past_a_damaged_latest_step(run, damage, capsys):
    DAMAGE[damage](run)
    assert main(["inspect", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert _quarantined(run) == ["4"]
    # The warning was printed by inspect (read above); the model is the previous step's for everyone.
    assert zaya_jax.load(run).step == 2
    assert checkpoint.read_config(run)[1] == 2 and checkpoint.describe(run)[1] == 2
    assert not warning or "step 4" in warning[0]


@pytest.mark.parametrize("command", ["eval", "generate", "inspect", "convert"])
def test_a_stray_step_directory_is_set_aside_by_every_command(run, tmp_path, command, capsys):
    (run / "checkpoints" / "9").mkdir()  # an interrupted copy, a user's mkdir
    argv = {
        "eval": ["eval", str(run), "--json"],
        "generate": ["generate", str(run), "--prompt", "ab", "--max-new-tokens", "2", "--json"],
        "inspect": ["inspect", str(run), "--json"],
        "convert": ["convert", "zaya-to-hf", str(run), str(tmp_path / "hf")],
    }[command]
    assert main(argv) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "checkpoint step 9" in line]
    assert len(lines) == 1 and lines[0].startswith(f"zaya {command}: warning:"), err
    assert "_CHECKPOINT_METADATA" in lines[0] and str(run / "quarantine") in lines[0]
    assert _quarantined(run) == ["9"] and sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "2",
        "4",
    ]


def test_a_step_holding_only_a_stray_file_is_set_aside_and_kept(run):
    _stray_step(run)
    assert zaya_jax.load(run).step == 4
    (moved,) = (run / "quarantine").iterdir()
    assert (moved / "notes.txt").read_text() == "copied by hand\n"


def test_an_explicit_damaged_step_is_one_line_naming_it_and_the_fix(run, capsys):
    shutil.rmtree(run / "checkpoints/4/params")
    assert main(["eval", str(run / "checkpoints" / "4")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("zaya eval: checkpoint step 4 cannot be used:")
    assert str(run / "checkpoints/4/params") in line and f"Give the run directory {run}" in line
    assert not (run / "quarantine").exists()  # an explicit step is never moved
    with pytest.raises(checkpoint.CheckpointCorruptError, match="params"):
        zaya_jax.load(run / "checkpoints" / "4")


def test_no_readable_step_left_lists_each_step_and_where_they_went(run, capsys):
    for step in (2, 4):
        (run / f"checkpoints/{step}/params/_METADATA").write_bytes(b"\x00garbage")
    assert main(["generate", str(run), "--prompt", "a"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds no readable checkpoint" in line and "step 4:" in line and "step 2:" in line
    assert "_METADATA" in line and str(run / "quarantine") in line
    assert _quarantined(run) == ["2", "4"]
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="no complete checkpoint"):
        zaya_jax.load(run)  # both set aside now: nothing left to look at


def test_a_config_that_does_not_fit_the_schema_is_an_error_not_damage(run):
    item = run / "checkpoints/4/config/metadata"
    data = json.loads(item.read_text())
    data["model"]["a_key_from_the_future"] = 1
    item.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="a_key_from_the_future") as err:
        zaya_jax.load(run)
    assert str(item) in str(err.value) and "another version" in str(err.value)
    assert not (run / "quarantine").exists()


def test_permission_errors_and_read_only_runs_move_nothing(run, monkeypatch):
    from zaya_jax.checkpoint import model_files, store

    real = model_files._restore_model_step

    def denied(checkpoints, step):
        raise PermissionError(13, "Permission denied", str(checkpoints / str(step) / "params"))

    monkeypatch.setattr(model_files, "_restore_model_step", denied)
    with pytest.raises(PermissionError):
        zaya_jax.load(run)
    assert not (run / "quarantine").exists()
    monkeypatch.setattr(model_files, "_restore_model_step", real)

    def read_only(checkpoints_dir, step, own=False):
        raise OSError(30, "Read-only file system", str(checkpoints_dir))

    monkeypatch.setattr(store, "quarantine", read_only)
    shutil.rmtree(run / "checkpoints/4/balancing")
    with pytest.warns(UserWarning, match="left in place"):
        assert zaya_jax.load(run).step == 2
    assert (run / "checkpoints" / "4").is_dir()


def test_training_resume_sets_aside_a_stray_step_and_a_lost_data_position(run, capsys):
    _stray_step(run)
    shutil.rmtree(run / "checkpoints/4/data")
    assert main(["train", *RUN, "train.steps=5", f"run.dir={run}"]) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    unreadable = [e["detail"] for e in events if e["event"] == "checkpoint_unreadable"]
    assert [e["checkpoint"] for e in unreadable] == [9, 4], unreadable
    assert "data position" in unreadable[1]["error"]
    assert [e["detail"]["from_step"] for e in events if e["event"] == "resume"] == [2]
    assert _quarantined(run) == ["4", "9"]


def test_init_from_a_damaged_run_uses_its_previous_step(run, tmp_path):
    from zaya_jax.train.init import _load_source, source_model_config

    (run / "checkpoints/4/fingerprints/metadata").write_text("[]")
    assert source_model_config(run).hidden_size == 32
    assert _load_source(run)[1]["step"] == 2


def test_a_run_whose_checkpoints_are_a_broken_link_is_named_not_overwritten(run, capsys):
    shutil.move(run / "checkpoints", run.parent / "elsewhere")
    (run / "checkpoints").symlink_to(run.parent / "moved-away")
    assert main(["train", *RUN, "train.steps=5", f"run.dir={run}"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{run / 'checkpoints'} is a broken link" in line
    assert (run / "checkpoints").is_symlink() and (run.parent / "elsewhere" / "4").is_dir()
