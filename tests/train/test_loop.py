"""``zaya train`` end to end on a miniature model: run directory contents, metrics fields, held-out
evaluation, the batch ramp and curriculum plan, and refusal to overwrite a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

import zaya_jax
from tests.fixtures import MINI
from zaya_jax.allocator import slow_path_warning
from zaya_jax.cli import main
from zaya_jax.config import ConfigError, config_from_dict, load_config
from zaya_jax.objectives.lm import plan_for
from zaya_jax.ops.kernel_plan import resolve_kernel_plan
from zaya_jax.train.loop import train


def test_train_writes_a_complete_run_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("zaya_jax.allocator._COMMAND", [True])  # as the zaya command runs it
    run = tmp_path / "run"
    assert main(["train", *MINI, f"run.dir={run}", "train.steps=6", "--no-progress"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["steps"] == 6 and summary["tokens"] == 6 * 2 * 32
    # a few lines on stderr say what starts: the run, its size and mesh, then the compile
    assert f"zaya train: {run} (new run)" in captured.err and "parameters (" in captured.err
    assert "zaya train: compiling the train step for batches of 2 x 32 tokens" in captured.err
    # pytest runs under the system's malloc: the zaya command says so in one line, with the fix
    slow = slow_path_warning()
    assert captured.err.count("zaya: CPU steps run under") == (1 if slow else 0)
    assert slow is None or slow in captured.err
    assert np.isfinite(summary["eval_loss"])

    cfg = config_from_dict(yaml.safe_load((run / "config.yaml").read_text()))
    assert cfg == load_config("tiny", [*MINI, f"run.dir={run}", "train.steps=6"])

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [line for line in lines if "loss" in line]
    eval_lines = [line for line in lines if "eval_loss" in line]
    assert [line["step"] for line in train_lines] == [2, 3, 4, 6]
    assert [line["step"] for line in eval_lines] == [0, 3, 6]  # the starting weights too (eval.at_start)
    for line in train_lines:
        for key in (
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "mfu",
            "expert_load",
            "skip_fraction",
            "data_wait_s",
        ):
            assert line[key] is not None, key
        assert len(line["expert_load"]) == 3  # 2 experts + skip
        assert line["mfu"] > 0
    assert eval_lines[-1]["eval_loss"] == pytest.approx(summary["eval_loss"])

    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["health_check", "start", "compiled", "end"]
    # the kernel plan the run resolved is recorded (tests/ops/test_kernel_plan.py: what each setting runs)
    assert events[1]["detail"]["kernels"] == resolve_kernel_plan(cfg.model, cfg.optim.kernels).describe()
    compiled = events[2]["detail"]
    assert compiled["program"] == "train_step" and compiled["batch"] == [2, 32]
    assert len(compiled["fingerprint"]) == 16  # the plan's train_step_fingerprint (tests/train/test_plan.py)
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tb").iterdir())

    lm = zaya_jax.load(run)  # the final model is a checkpoint that evaluation can load
    assert lm.step == 6
    assert lm.logits(np.array([[5, 6, 7]])).shape == (1, 3, lm.config.vocab_size)

    # Running the finished run again trains nothing and keeps its summary (no nulls written over it).
    saved = (run / "summary.json").read_text()
    assert main(["train", *MINI, f"run.dir={run}", "train.steps=6", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(saved)
    assert (run / "summary.json").read_text() == saved


def test_train_refuses_to_overwrite_an_existing_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    cfg = load_config("tiny", [*MINI, f"run.dir={run}", "train.steps=1"])
    with pytest.raises(FileExistsError, match="already holds a run"):
        train(cfg, progress=False)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 3.0}\n'


def test_vocabulary_smaller_than_the_tokenizer_is_a_config_error(tmp_path):
    cfg = load_config("tiny", [*MINI, f"run.dir={tmp_path / 'run'}", "model.vocab_size=200"])
    with pytest.raises(ConfigError, match=r"set model.vocab_size >= 259"):
        train(cfg, progress=False)


def test_plan_follows_the_batch_ramp_and_curriculum_stages():
    cfg = load_config(
        "tiny",
        [
            "train.batch_size=8",
            "train.batch_ramp=[{tokens: 0, batch_size: 2}, {tokens: 1000, batch_size: 4}, {tokens: 5000, batch_size: 8}]",
            "train.stages=[{tokens: 2000, seq_len: 64}, {tokens: 100000, seq_len: 256, mixture: [1.0]}]",
        ],
    )
    plans = {tokens: plan_for(cfg, tokens) for tokens in (0, 999, 1000, 1999, 2000, 5000, 10**9)}
    assert [p.batch_size for p in plans.values()] == [2, 2, 4, 4, 4, 8, 8]
    assert [p.seq_len for p in plans.values()] == [64, 64, 64, 64, 256, 256, 256]
    assert plans[2000].stage == 1 and plans[2000].mixture == (1.0,)
    assert plans[10**9].stage == 1  # the last stage continues until train.steps


def test_ramp_and_stages_run_end_to_end(tmp_path):
    run = tmp_path / "run"
    overrides = [
        *MINI,
        f"run.dir={run}",
        "train.steps=6",
        "log.every=1",
        "eval.every=100",
        "train.batch_ramp=[{tokens: 0, batch_size: 1}, {tokens: 64, batch_size: 2}]",
        "train.stages=[{tokens: 96, seq_len: 16}, {tokens: 10000, seq_len: 32}]",
    ]
    train(load_config("tiny", overrides), progress=False)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in lines if "loss" in line]
    assert [(line["batch_size"], line["seq_len"], line["stage"]) for line in lines] == [
        (1, 16, 0),
        (1, 16, 0),
        (1, 16, 0),
        (1, 16, 0),
        (2, 16, 0),
        (2, 32, 1),
    ]
