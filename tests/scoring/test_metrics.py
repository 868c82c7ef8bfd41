"""pass@k, avg@n and maj@k (:mod:`zaya_jax.scoring.metrics`) against brute force: pass@k is the mean
over every k-subset of the n samples of "one of them is correct", computed here by enumerating the
subsets; majority voting by counting the votes by hand; standard errors against the textbook
formula; k larger than the samples refused with a message that says what to change."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from zaya_jax.scoring.metrics import estimate, majority_correct, pass_at_k, score_samples


def _brute_pass(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_mean_over_every_k_subset(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_pass(correct, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # the product form stays exact where C(n, k) overflows a float
    assert pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)
    assert pass_at_k(2000, 0, 1000) == 0.0
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    assert pass_at_k(2000, 1001, 1000) == 1.0


def test_k_past_the_samples_and_impossible_counts_are_refused():
    with pytest.raises(
        ValueError, match=r"k=9 needs at least 9 samples per prompt, and there are 8: raise the samples"
    ):
        pass_at_k(8, 2, 9)
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k(8, 2, 0)
    with pytest.raises(ValueError, match="9 correct of 8"):
        pass_at_k(8, 9, 1)
    with pytest.raises(ValueError, match="k=4 needs at least 4"):
        score_samples([[True, False, True]], ks=[1, 4])
    with pytest.raises(ValueError, match="same number of samples"):
        score_samples([[True, False], [True]], ks=[1])


def test_majority_voting_counts_votes_among_the_first_k_and_breaks_ties_by_first_seen():
    keys = ["3", "4", "4", "3", "5", None, None, None]
    correct = [True, False, False, True, False, False, False, False]
    assert majority_correct(keys, correct, 1)  # "3" alone
    assert majority_correct(keys, correct, 2)  # "3" and "4" tie: "3" was seen first
    assert not majority_correct(keys, correct, 3)  # "4" twice
    assert majority_correct(keys, correct, 4)  # 2 - 2: "3" first again
    # unread answers never win, however many: "3" and "4" tie at 2 among the first 8
    assert majority_correct(keys, correct, 8)
    assert not majority_correct([None, None], [False, False], 2)
    # a winner with one correct sample in its class is correct (the checker is the judge)
    assert majority_correct(["x", "x", "y"], [False, True, False], 3)


def test_scores_are_means_over_prompts_with_their_standard_errors():
    rng = np.random.default_rng(0)
    correct = rng.random((40, 6)) < np.linspace(0.05, 0.95, 40)[:, None]
    keys = [[str(int(ok)) if rng.random() < 0.9 else None for ok in row] for row in correct]
    scores = score_samples(correct.tolist(), ks=[1, 4, 6], keys=keys)
    assert set(scores) == {"avg@6", "pass@1", "pass@4", "pass@6", "maj@1", "maj@4", "maj@6"}
    per_prompt = correct.mean(1)
    assert scores["avg@6"].value == pytest.approx(per_prompt.mean())
    assert scores["avg@6"].stderr == pytest.approx(per_prompt.std(ddof=1) / math.sqrt(40))
    assert scores["pass@1"].value == pytest.approx(per_prompt.mean())  # pass@1 is the mean accuracy
    brute4 = [_brute_pass(row, 4) for row in correct.tolist()]
    assert scores["pass@4"].value == pytest.approx(np.mean(brute4))
    assert scores["pass@4"].stderr == pytest.approx(np.std(brute4, ddof=1) / math.sqrt(40))
    assert scores["pass@6"].value == pytest.approx(correct.any(1).mean())
    votes = [majority_correct(k, c, 4) for k, c in zip(keys, correct.tolist(), strict=True)]
    assert scores["maj@4"].value == pytest.approx(np.mean(votes))
    assert scores["pass@1"].value <= scores["pass@4"].value <= scores["pass@6"].value
    one = estimate([0.25])
    assert (one.value, one.stderr) == (0.25, 0.0)
