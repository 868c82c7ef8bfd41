"""GRPO's held-out evaluation with sampled answers (``rl.eval_samples``): the training curve logs
pass@1, pass@n, maj@n and avg@n of n samples per held-out prompt, computed by the same code as
``zaya eval --task`` (:mod:`zaya_jax.eval.reasoning`), and ``zaya eval RUN`` of the saved run
reproduces the numbers the run logged at that step."""

from __future__ import annotations

import json

import pytest

from tests.fixtures import GRPO
from zaya_jax.cli import main

SAMPLED = ["rl.eval_samples=4", "rl.temperature=1.0", "rl.reward=tests.fixtures:even_first_character"]


def test_the_held_out_curve_of_sampled_answers_is_what_zaya_eval_reports(tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        main(["train", *GRPO, *SAMPLED, f"run.dir={run}", "train.steps=2", "eval.every=2", "--no-progress"])
        == 0
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval_reward" in r]
    assert [r["step"] for r in evaluated] == [0, 2]
    last = evaluated[-1]
    names = (
        "eval_pass@1",
        "eval_pass@4",
        "eval_maj@4",
        "eval_avg@4",
        "eval_truncated",
        "eval_reward_unparsed",
    )
    assert all(name in last for name in names)
    assert 0 < last["eval_pass@1"] < 1 and last["eval_pass@1"] <= last["eval_pass@4"]
    assert last["eval_pass@1"] == pytest.approx(last["eval_avg@4"])  # one sample's chance, both ways
    assert last["eval_loss"] == -last["eval_reward"]

    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0  # the run's held-out evaluation, reproduced
    again = json.loads(capsys.readouterr().out)
    for name in names:
        assert again[name.removeprefix("eval_")] == pytest.approx(last[name], abs=1e-9), name
    assert again["reward"] == pytest.approx(last["eval_reward"], abs=1e-9)


def test_negative_eval_samples_are_refused(capsys):
    assert main(["train", *GRPO, "rl.eval_samples=-1", "--compile-only"]) == 2
    assert "rl.eval_samples=-1 must be >= 0" in capsys.readouterr().err
