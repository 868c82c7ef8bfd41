"""Node health acting on a run (``resilience.on_unhealthy``), with a fake ``amd-smi`` on PATH
(tests/resilience/faults.py): a GPU reporting uncorrectable ECC errors mid-run drains the run (the
step after is saved, ``drain.json`` names node and probe, exit 76) and the run resumes from it; a
failing node refuses to start (76 with drain, 77 with stop, nothing written); ``warn`` only tells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures import MINI
from tests.resilience import faults
from zaya_jax.cli import main
from zaya_jax.resilience.health import DRAIN_RECORD, EXIT_DRAIN, EXIT_UNHEALTHY, node_name

STEPS = 6


def _args(run: Path, *extra: str) -> list[str]:
    return [
        "train", *MINI, f"run.dir={run}", f"train.steps={STEPS}", "eval.every=100",
        "checkpoint.every_steps=100", "resilience.health_every_s=0.05", *extra, "--no-progress",
    ]  # fmt: skip


@pytest.fixture
def fake_smi(tmp_path, monkeypatch) -> Path:
    directory, env = faults.fake_amd_smi(tmp_path / "smi")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return directory


def _events(run: Path, name: str) -> list[dict]:
    lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [e for e in lines if e["event"] == name]


def test_an_ecc_error_mid_run_drains_at_the_next_step_and_the_run_resumes(tmp_path, fake_smi, capsys):
    run = tmp_path / "run"
    code = main(_args(run), hooks=[faults.FaultHook({"gpu_ecc_at_step": 2})])
    assert code == EXIT_DRAIN
    err = capsys.readouterr().err
    assert f"node {node_name()}: gpu probe: GPU 1: 2 uncorrectable ECC errors" in err
    drain = json.loads((run / DRAIN_RECORD).read_text())
    assert drain["policy"] == "drain" and drain["at"] == "step"
    assert [(f["node"], f["probe"]) for f in drain["findings"]] == [(node_name(), "gpu")]
    step = drain["step"]
    assert 2 < step < STEPS  # the step the failure rode on, saved
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [step]
    (check,) = _events(run, "health_check")  # the preflight: every probe, on every process
    assert {f["probe"] for f in check["detail"]["findings"]} == {"gpu", "nic", "filesystem", "clock"}
    assert {f["status"] for f in check["detail"]["findings"] if f["probe"] == "gpu"} == {"ok"}
    (health,) = [e for e in _events(run, "health") if e["detail"]["status"] == "fail"]
    assert health["step"] == drain["found_at_step"] and health["detail"]["process"] == 0
    assert step - health["step"] in (0, 1)  # with dispatch ahead the stop lands one step later
    assert _events(run, "stop")[-1]["detail"]["signal"] == "drain"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == step and summary["goodput"]["attempts"] == 1
    _check_goodput(summary["goodput"], summary["wall_time_s"])

    (fake_smi / f"ecc-{__import__('os').getpid()}").unlink()  # the node is repaired (or replaced)
    assert main(_args(run)) == 0
    assert _events(run, "resume")[-1]["detail"]["from_step"] == step
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["goodput"]["attempts"] == 2
    _check_goodput(summary["goodput"])
    assert summary["goodput"]["badput_s"]["restart_gap"] > 0 and summary["goodput"]["badput_s"]["lost"] == 0
    assert main(["inspect", str(run)]) == 0
    assert "goodput" in capsys.readouterr().out


def _check_goodput(goodput: dict, wall_time_s: float | None = None) -> None:
    """Every second lands in one kind; with one attempt the total is the run's own wall time."""
    bad = goodput["badput_s"]
    assert goodput["productive_s"] > 0 and min(bad.values()) >= 0
    assert bad["startup"] > 0 and bad["evaluation"] > 0 and bad["checkpoint"] > 0
    assert goodput["productive_s"] + sum(bad.values()) == pytest.approx(goodput["wall_s"], rel=1e-9)
    assert goodput["goodput"] == pytest.approx(goodput["productive_s"] / goodput["wall_s"])
    if wall_time_s is not None:  # measured apart, in train(): they differ by the summary's own writing
        assert goodput["wall_s"] == pytest.approx(wall_time_s, rel=0.02, abs=0.5)


@pytest.mark.parametrize("policy", ["drain", "stop", "warn"])
def test_a_failing_node_refuses_to_start_unless_told_to_warn(tmp_path, fake_smi, capsys, policy):
    (fake_smi / "ecc-all").write_text("")
    run = tmp_path / "run"
    extra = [f"resilience.on_unhealthy={policy}", "train.steps=1"]
    code = main(_args(run, *extra))
    err = capsys.readouterr().err
    line = f"node {node_name()}: gpu probe: GPU 1: 2 uncorrectable ECC errors"
    assert line in err
    if policy == "warn":
        assert code == 0 and (run / "checkpoints" / "1").is_dir()
        return
    assert code == {"drain": EXIT_DRAIN, "stop": EXIT_UNHEALTHY}[policy]
    (refusal,) = [x for x in err.splitlines() if x.startswith("zaya train: node")]
    assert "refusing to start" in refusal and line in refusal
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert json.loads((run / DRAIN_RECORD).read_text())["at"] == "preflight"
    (check,) = _events(run, "health_check")
    assert [f["status"] for f in check["detail"]["findings"] if f["probe"] == "gpu"] == ["fail"]


@pytest.mark.parametrize("fault", ["disk_full_at_step", "disk_low_at_step"])
def test_a_filling_disk_stops_before_a_save_that_would_not_fit_or_drains_with_the_last_one(
    tmp_path, capsys, fault
):
    """From step 3 the run directory's filesystem reads as short of one checkpoint's room (full)
    or as holding room for one more only (low). Checked before the save due at step 4 (and by the
    thread), full stops without starting a save that could not be written whole, step 2's
    checkpoint standing; low drains: the next step is saved. Both exit 77: a shared filesystem
    short of space is no node's fault, so no restart elsewhere would help."""
    run = tmp_path / "run"
    extra = ["checkpoint.every_steps=2", "resilience.health_every_s=3600"]  # the pre-save check acts
    code = main(_args(run, *extra), hooks=[faults.FaultHook({fault: 3})])
    err = capsys.readouterr().err
    assert code == EXIT_UNHEALTHY
    (line,) = [x for x in err.splitlines() if x.startswith("zaya train: node")]
    assert f"node {node_name()}: filesystem probe: {run} has" in line
    assert line.endswith("free space there (or move run.dir) and restart: no other node fixes it")
    drain = json.loads((run / DRAIN_RECORD).read_text())
    (finding,) = drain["findings"]
    assert finding["detail"]["shared"] and finding["detail"]["needed_bytes"] > 1 << 20
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir())
    if fault == "disk_full_at_step":
        assert "the next checkpoint needs about" in line and "it would not fit" in line
        assert "stopped at step 4 without saving it" in line  # the first step a save was due
        assert saved == [2] and not drain["saved"] and not finding["detail"]["fits"]
    else:
        assert "room for one more checkpoint of about" in line and "saved step 4" in line
        assert saved == [2, 4] and drain["saved"] and finding["detail"]["fits"]
