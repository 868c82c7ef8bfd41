"""Reasoning evaluation (``zaya eval RUN --task``, :mod:`zaya_jax.eval.reasoning`) on a miniature
model: n sampled answers per prompt through the rollout engine, every verdict the checker's on the
answer with its reasoning removed, the cut and unparsed answers counted, the scores recomputed here
by brute force from the samples it wrote, the same samples whatever the slots; and from the
command line, a damaged task file and a k past the samples each one line naming what to change, and
every checkpoint of the run into one curve, an interrupted evaluation resumed without evaluating a
finished step again."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from tests.fixtures import MINI, even_first_character
from zaya_jax.cli import main
from zaya_jax.data.tasks import add_chats, write_jsonl
from zaya_jax.eval.reasoning import evaluate_reasoning
from zaya_jax.scoring.answers import answer_key, strip_reasoning

CHECK = "tests.fixtures:even_first_character"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("reasoning") / "run"
    overrides = [*MINI, f"run.dir={path}", "train.steps=2", "checkpoint.every_steps=1", "checkpoint.keep=5"]
    assert main(["train", *overrides, "--no-progress"]) == 0
    return path


def _brute_pass(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_reasoning_blocks_are_removed_and_an_open_one_leaves_no_answer():
    assert strip_reasoning("<think>2+2 is 5?\nno</think>The answer is 4") == ("The answer is 4", False)
    assert strip_reasoning("<think>a</think>x<think>b</think>y") == ("xy", False)
    assert strip_reasoning("<think>still thinking when the budget ran") == ("", True)
    assert strip_reasoning("done <think>again") == ("done ", True)
    assert answer_key("so \\boxed{\\frac{1}{2}} and then \\boxed{ 3 }") == "3"
    assert answer_key(" 4 2 ") == "42"


def test_samples_are_checked_counted_and_scored_as_written(run, tmp_path):
    import zaya_jax

    lm = zaya_jax.load(run)
    records = add_chats(6, seed=5)
    settings = dict(check=CHECK, samples=4, ks=[1, 2, 4], temperature=1.0, max_new_tokens=6, seed=3)
    result = evaluate_reasoning(lm, records, slots=8, **settings)
    samples = result.samples
    assert [(s.prompt, s.sample) for s in samples] == [(i, j) for i in range(6) for j in range(4)]
    stops = set(lm.stop_token_ids)
    for s in samples:  # each verdict is the checker's on the completion the sample holds
        value = even_first_character(records[s.prompt], s.completion)
        assert (s.score, s.correct, s.parsed) == (float(value), float(value) == 1.0, value.parsed)
        assert s.tokens <= 6 and s.truncated == (s.tokens == 6 and not s.completion.endswith("</s>"))
    correct = [[s.correct for s in samples[4 * i : 4 * i + 4]] for i in range(6)]
    assert 0 < np.mean(correct) < 1  # the scores below are of a mixed set, not all of one kind
    for k in (1, 2, 4):
        assert result.metrics[f"pass@{k}"].value == pytest.approx(
            np.mean([_brute_pass(c, k) for c in correct])
        )
    assert result.metrics["avg@4"].value == pytest.approx(np.mean(correct))
    assert result.truncated == np.mean([s.truncated for s in samples]) > 0
    assert result.unparsed == np.mean([not s.parsed for s in samples])
    assert stops  # the model stops somewhere

    # the same samples whatever the engine's slots: sample j of prompt i has its own random stream
    again = evaluate_reasoning(lm, records, slots=3, **settings)
    assert [s.completion for s in again.samples] == [s.completion for s in samples]

    out = result.write(tmp_path / "eval")
    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 24 and lines[5]["answer"] == records[1]["answer"]
    assert (
        lines[5]["messages"] == records[1]["messages"][:1] and lines[5]["completion"] == samples[5].completion
    )
    scores = json.loads((out / "scores.json").read_text())
    assert scores["pass@2"] == result.metrics["pass@2"].value and scores["prompts"] == 6
    assert scores["settings"]["samples"] == 4 and "pass@2_stderr" in scores


def test_zaya_eval_task_writes_beside_the_run_and_refuses_bad_input(run, tmp_path, capsys):
    task = write_jsonl(tmp_path / "sums.jsonl", add_chats(3, seed=9))
    argv = [
        "eval",
        str(run),
        "--task",
        str(task),
        "--samples",
        "2",
        "--max-new-tokens",
        "4",
        "--check",
        CHECK,
    ]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompts"] == 3 and {"pass@1", "pass@2", "maj@2", "avg@2", "truncated"} <= set(summary)
    written = run / "evals" / "sums" / "step-2"  # the run's latest step
    assert json.loads((written / "scores.json").read_text())["pass@2"] == summary["pass@2"]
    assert len((written / "samples.jsonl").read_text().splitlines()) == 6

    assert main([*argv, "--k", "3"]) == 2
    assert "k=3 needs at least 3 samples per prompt, and there are 2" in capsys.readouterr().err

    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text(task.read_text().splitlines()[0] + "\n{not json\n")
    assert main(["eval", str(run), "--task", str(damaged)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{damaged}:2" in err[0]


def test_every_checkpoint_into_one_curve_resumed_without_evaluating_a_finished_step_again(
    run, tmp_path, capsys
):
    task = write_jsonl(tmp_path / "sums.jsonl", add_chats(2, seed=11))
    argv = ["eval", str(run), "--task", str(task), "--samples", "2", "--max-new-tokens", "4", "--check", CHECK,
            "--checkpoints", "all", "--out", str(tmp_path / "curve")]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert [line["step"] for line in first] == [1, 2]
    curve = [json.loads(line) for line in (tmp_path / "curve" / "curve.jsonl").read_text().splitlines()]
    assert curve == first

    # killed while evaluating step 2: its samples written, its scores (written last) not
    done = tmp_path / "curve" / "step-1" / "scores.json"
    stamp = done.stat().st_mtime_ns
    (tmp_path / "curve" / "step-2" / "scores.json").unlink()
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert "step 1: evaluated already" in captured.err and "step 2: evaluating" in captured.err
    assert done.stat().st_mtime_ns == stamp  # step 1 was not evaluated again
    assert json.loads(captured.out) == first  # step 2 again: the same samples, the same scores

    # another setting is refused, not mixed into the curve
    assert main([*argv[:5], "3", *argv[6:], "--k", "1"]) == 2
    assert "evaluated with other settings (ks, samples)" in capsys.readouterr().err
    assert main([*argv[:-4], "--checkpoints", "7"]) == 2
    assert "step(s) 7 are not kept" in capsys.readouterr().err
