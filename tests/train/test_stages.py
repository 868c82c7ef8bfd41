"""Curriculum stages that change the model (context extension: RoPE base and scaling at a stage
boundary) and the learning rate's segment: the plan, the config a checkpoint records, what a
resumed run may change, and a run killed before, at and after the boundary."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import MINI
from tests.resilience import faults
from zaya_jax.config import ConfigError, Stage, StageRope, load_config
from zaya_jax.objectives.lm import plan_for

EXTENDED = "{theta: 40000, theta_sliding: 10000, scaling: {rope_type: yarn, factor: 2, original_max_position_embeddings: 32}}"
# MINI's batch of 2 rows: stage 0 is steps 1-4 (64 tokens each), stage 1 from step 5 (128 each).
STAGES = f"train.stages=[{{tokens: 256, seq_len: 32}}, {{tokens: 1024, seq_len: 64, rope: {EXTENDED}, lr_scale: [1.0, 0.25]}}]"


def _cfg(*extra: str):
    return load_config("tiny", [*MINI, STAGES, *extra])


def test_the_plan_follows_the_stage_and_its_learning_rate_segment():
    cfg = _cfg()
    assert [plan_for(cfg, t).stage for t in (0, 255, 256, 10**6)] == [0, 0, 1, 1]
    assert plan_for(cfg, 255).lr_scale == 1.0  # stage 0 has no segment
    assert [plan_for(cfg, t).lr_scale for t in (256, 256 + 512, 256 + 1024, 10**6)] == [
        1.0,
        0.625,
        0.25,
        0.25,
    ]


def test_a_stage_changes_the_model_and_a_checkpoint_records_the_model_in_force():
    cfg = _cfg()
    assert cfg.stage_model(0) == cfg.model
    extended = cfg.stage_model(1)
    assert extended.rope_theta == 40000 and extended.rope_scaling.factor == 2
    assert extended.architecture() != cfg.model.architecture()
    saved = cfg.at_stage(1)
    assert saved.model == extended
    # every stage states its RoPE, so the recorded curriculum trains stage 0 as the run did
    assert saved.train.stages[0].rope == StageRope(cfg.model.rope_theta, cfg.model.rope_theta_sliding)
    assert saved.stage_model(0) == cfg.model and saved.stage_model(1) == extended


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.stages=[{tokens: 0, seq_len: 32}]", r"train\.stages\[0\] needs positive tokens"),
        (
            "train.stages=[{tokens: 8, seq_len: 32, lr_scale: [1, -1]}]",
            r"lr_scale=\[1\.0, -1\.0\] must be two",
        ),
        (
            "train.stages=[{tokens: 8, seq_len: 32, rope: {theta: 1e4, theta_sliding: 1e4, scaling: {factor: 4}}}]",
            r"train\.stages\[0\]\.rope\.scaling\.original_max_position_embeddings is needed by yarn",
        ),
        (
            "train.stages=[{tokens: 8, seq_len: 32, rope: {theta: 1e4}}]",
            r"train\.stages\[0\]\.rope\.theta_sliding must be given",
        ),
    ],
)
def test_bad_stages_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [override])


def _with_stage(train, index: int, **changes):
    stages = list(train.stages)
    stages[index] = dataclasses.replace(stages[index], **changes)
    return dataclasses.replace(train, stages=tuple(stages))


def test_what_a_resumed_run_may_change_in_its_curriculum():
    train = _cfg().train
    assert train.history_change(train, 10**6) is None
    # stage 0 trained: its fields and its end are history
    assert _with_stage(train, 0, seq_len=16).history_change(train, 64) == (
        "train.stages[0].seq_len changed from 32 to 16"
    )
    assert (
        _with_stage(train, 0, tokens=512).history_change(train, 300)
        == "train.stages[0].tokens changed from 256 to 512"
    )
    # in stage 0 still: it may end elsewhere (after what it has trained), stage 1 may change freely
    assert _with_stage(train, 0, tokens=512).history_change(train, 192) is None
    assert (
        _with_stage(train, 0, tokens=128).history_change(train, 192)
        == "train.stages[0].tokens changed from 256 to 128"
    )
    assert _with_stage(train, 1, seq_len=128).history_change(train, 256) is None
    assert (
        _with_stage(train, 1, seq_len=128).history_change(train, 257)
        == "train.stages[1].seq_len changed from 64 to 128"
    )
    # stage 1's learning rate slopes over its length: the length is history once it has begun
    assert (
        _with_stage(train, 1, tokens=2048).history_change(train, 300)
        == "train.stages[1].tokens changed from 1024 to 2048"
    )
    # a run without stages may go on with a context-extension stage after what it trained
    plain = load_config("tiny", [*MINI]).train
    extended = dataclasses.replace(
        plain, stages=(Stage(tokens=640, seq_len=32), Stage(tokens=64, seq_len=64))
    )
    assert extended.history_change(plain, 640) is None
    assert extended.history_change(plain, 704) == "train.stages[0].tokens changed from 1 to 640"
    assert (
        dataclasses.replace(plain, seq_len=64).history_change(plain, 64)
        == "train.seq_len changed from 32 to 64"
    )


def _train(
    run: Path, *extra: str, prefix=(sys.executable, "-m", "zaya_jax.cli")
) -> subprocess.CompletedProcess:
    cmd = [
        *prefix, "train", *MINI, STAGES, f"run.dir={run}", "train.steps=7", "log.every=1", "eval.every=100",
        "checkpoint.every_steps=1", "checkpoint.keep=8", "checkpoint.async_save=false", "--no-progress", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_killed_before_at_and_after_the_boundary_resumes_bit_identical(tmp_path):
    """SIGKILLed three times: after step 3 while saving in the background (the default: it resumes
    from step 2 or 3, whichever save was committed), then with synchronous saves after step 4 (the
    last of stage 0) and step 5 (the first with the extended RoPE), each resuming from that step;
    a resume that changes stage 0 in between is refused. The losses, learning rates and shapes of
    every step equal the uninterrupted run's, bit for bit."""
    reference = tmp_path / "reference"
    assert _train(reference).returncode == 0
    run = tmp_path / "killed"
    for step, saves in ((3, "true"), (4, "false"), (5, "false")):
        (run / faults.FIRED).unlink(missing_ok=True)
        crashed = _train(
            run, f"checkpoint.async_save={saves}", prefix=faults.command(f"crash_at_step={step}")
        )
        assert crashed.returncode == -9, crashed.stderr[-3000:]
    changed = _train(run, STAGES.replace("seq_len: 32", "seq_len: 16"))
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert (
        "has trained 384 tokens" in changed.stderr
        and "train.stages[0].seq_len changed from 32 to 16" in changed.stderr
    )
    finished = _train(run)
    assert finished.returncode == 0, finished.stderr[-3000:]

    def trained(path: Path) -> dict[int, tuple]:
        return {
            r["step"]: (r["loss"], r["lr"], r["seq_len"], r["stage"]) for r in _records(path) if "loss" in r
        }

    assert trained(run) == trained(reference)  # bit-identical, step for step, nothing logged twice
    assert [trained(run)[s][2:] for s in (4, 5)] == [(32, 0), (64, 1)]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    resumed = [e["detail"]["from_step"] for e in events if e["event"] == "resume"]
    assert resumed[0] in (2, 3) and resumed[1:] == [4, 5]
    from zaya_jax.checkpoint import read_config

    assert read_config(run / "checkpoints" / "4")[0].model.rope_theta == 10000.0
    saved = read_config(run / "checkpoints" / "7")[0].model
    assert saved.rope_theta == 40000.0 and saved.rope_scaling.factor == 2.0
