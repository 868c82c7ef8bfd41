"""The built-in verifiable rewards (:mod:`zaya_jax.rewards`) on a set of our own: equivalent forms
of one answer, wrong answers and replies with no answer (counted apart, not 0 in silence), exact
match and the boxed format; and reward calls held to their time limit, in the trainer's process
and in a pool of workers, a hanging call cut and named."""

from __future__ import annotations

import pickle
import sys
import time

import pytest

from zaya_jax.rewards import Score, boxed_format, exact_match, math_answer, reference_answer, reply_text
from zaya_jax.rewards.calls import RewardError, RewardFunction

pytest.importorskip("math_verify")  # in the dev extra: a missing one skips here, fails CI's install


def _record(answer: str) -> dict:
    return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]}


EQUIVALENT = [  # (reference, a reply that states the same answer)
    ("85", "85<|im_end|>"),
    ("85", "The sum is \\boxed{85}.</s>"),
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "$\\frac{1}{2}$"),
    ("\\boxed{\\frac{3}{4}}", "3/4"),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}"),
    ("x^2 + 2x + 1", "$(x+1)^2$"),
    ("10\\%", "0.1"),
]
WRONG = [
    ("85", "84"),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"),
    ("2\\sqrt{2}", "2.83"),
    ("85", "\\boxed{58}"),
]
UNPARSED = ["I do not know<|im_end|>", "", "<|im_end|>", "the answer is seventy"]


@pytest.mark.parametrize(("reference", "reply"), EQUIVALENT)
def test_math_answer_accepts_equivalent_forms(reference, reply):
    score = math_answer(_record(reference), reply)
    assert score == 1.0 and score.parsed


@pytest.mark.parametrize(("reference", "reply"), WRONG)
def test_math_answer_rejects_wrong_answers_it_could_read(reference, reply):
    score = math_answer(_record(reference), reply)
    assert score == 0.0 and score.parsed


@pytest.mark.parametrize("reply", UNPARSED)
def test_a_reply_without_an_answer_scores_zero_and_is_marked_unparsed(reply):
    score = math_answer({"answer": "85", "messages": []}, reply)
    assert score == 0.0 and not score.parsed
    again = pickle.loads(pickle.dumps(score))  # as a reward worker returns it
    assert type(again) is Score and again == 0.0 and not again.parsed


def test_the_reference_is_the_answer_field_else_the_final_reply_and_must_exist():
    assert reference_answer({"answer": 7, "messages": []}) == "7"
    assert reference_answer(_record("cba")) == "cba"
    with pytest.raises(ValueError, match="'answer' field"):
        reference_answer({"messages": [{"role": "user", "content": "q"}]})
    with pytest.raises(ValueError, match="reads no answer in the reference"):
        math_answer({"answer": " "}, "1")


def test_exact_match_and_the_boxed_format():
    assert reply_text("  cba <|im_end|>\nmore") == "cba"
    assert exact_match(_record("cba"), "cba<|im_end|>") == 1.0
    assert exact_match(_record("cba"), "cb a</s>") == 0.0
    assert boxed_format({}, "so \\boxed{\\frac{1}{2}}<|im_end|>") == 1.0
    assert boxed_format({}, "\\boxed{1} or \\boxed{2}") == 0.0  # one answer, not two
    assert boxed_format({}, "\\boxed{} ") == 0.0 and boxed_format({}, "\\boxed{1") == 0.0


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A reward module in the working directory: ``fast`` answers at once, ``slow`` sleeps past any
    limit (in Python), ``swallow`` catches every Exception around its sleep."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zr_timing.py").write_text(
        "import time\n"
        "def fast(record, text):\n    return float(len(text))\n"
        "def slow(record, text):\n    time.sleep(60 if text == 'hang' else 0)\n    return 1.0\n"
        "def swallow(record, text):\n"
        "    try:\n        time.sleep(60)\n    except Exception:\n        return 0.0\n    return 1.0\n"
    )
    yield tmp_path
    sys.modules.pop("zr_timing", None)


RECORD = _record("x")


def test_a_hanging_reward_is_cut_at_its_limit_and_named(reward_module):
    stop = RewardFunction("zr_timing:slow", timeout=0.5)
    began = time.monotonic()
    with pytest.raises(RewardError, match=r"ran past rl\.reward_timeout=0\.5 s for the prompt 'q'"):
        stop(RECORD, "hang")
    assert time.monotonic() - began < 30  # cut, not slept out
    skip = RewardFunction("zr_timing:swallow", on_error="skip", timeout=0.5)
    assert skip(RECORD, "hang") is None and skip.errors == 1  # except Exception does not swallow it
    assert "rl.reward_timeout" in skip.problem
    assert RewardFunction("zr_timing:slow", timeout=0.5)(RECORD, "ok") == 1.0  # the timer is disarmed


def test_rewards_scored_in_workers_equal_the_trainers_and_a_hanging_one_is_cut(reward_module):
    records, texts = [RECORD] * 6, ["a", "bb", "ccc", "hang", "ee", "f"]
    pool = RewardFunction("zr_timing:slow", on_error="skip", timeout=1.0, workers=2)
    try:
        scores = pool.score(records, texts)
        assert scores == [1.0, 1.0, 1.0, None, 1.0, 1.0] and pool.errors == 1
        assert "ran past rl.reward_timeout=1 s" in pool.problem
        fast = RewardFunction("zr_timing:fast", workers=2)
        assert fast.score(records, texts) == [float(len(t)) for t in texts]
        fast.close()
    finally:
        pool.close()
    # Score's flag survives the trip through a worker
    marked = RewardFunction("zaya_jax.rewards:math_answer", workers=2)
    try:
        out = marked.score([{"answer": "85"}] * 3, ["85", "84", "no idea"])
    finally:
        marked.close()
    assert [(float(s), s.parsed) for s in out] == [(1.0, True), (0.0, True), (0.0, False)]


def test_a_grpo_run_with_math_answer_counts_unparsed_replies_apart(tmp_path):
    """``rl.reward=zaya_jax.rewards:math_answer`` on the addition task, scored in two workers: the
    rollouts' and the held-out evaluation's share of replies without a readable answer are logged
    (``reward_unparsed``, ``eval_reward_unparsed``) beside the rewards."""
    import json

    from tests.fixtures import GRPO
    from zaya_jax.cli import main
    from zaya_jax.data.tasks import add_chats, write_jsonl

    prompts = write_jsonl(tmp_path / "add.jsonl", add_chats(200, seed=3))
    run = tmp_path / "run"
    args = [*GRPO, f"rl.prompts={prompts}", "rl.reward=zaya_jax.rewards:math_answer", "rl.reward_workers=2"]
    args += ["data.held_out_fraction=0.1", "train.steps=1", "eval.every=1", "--no-progress"]
    assert main(["train", *args, f"run.dir={run}"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "loss" in r)
    evals = [r for r in records if "eval_reward" in r]
    assert 0 <= step["reward_unparsed"] <= 1 and 0 <= step["reward"] <= 1 - step["reward_unparsed"]
    assert len(evals) == 2 and all(0 <= r["eval_reward_unparsed"] <= 1 for r in evals)  # step 0 and 1
