"""Scores of sampled answers as reasoning models are reported: pass@k, avg@k and maj@k over ``n``
samples per prompt, each with its standard error over prompts.

- **pass@k**: the chance that at least one of k samples is correct, by the unbiased estimator of
  Chen et al. (2021, "Evaluating Large Language Models Trained on Code"): with ``c`` of ``n``
  samples correct, ``1 - C(n - c, k) / C(n, k)``, the mean over every k-subset of the n samples.
- **avg@n**: the mean correctness of the n samples (``c / n``), what ZAYA1-8B's and DeepSeek-R1's
  reasoning tables report as avg@k with k = n samples (the expected share correct of any k of
  them is the same, so it is reported once, at n).
- **maj@k**: whether the most common answer among the first k samples is correct (majority
  voting, self-consistency; ties go to the answer seen first), as lighteval computes it. Answers
  are grouped by a key the caller gives (the checker's normalised answer); unparsed ones never win.

Each metric is the mean over prompts of a per-prompt value; its standard error is the sample
standard deviation of those values over the square root of the number of prompts (lm-eval's
``stderr`` of a mean). The estimator is written here (eight lines) rather than taken from a
library: lm-eval and lighteval each keep their own copy inside their task code, not as an API.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` of ``n`` samples correct (``k <= n``)."""
    if not 0 <= c <= n:
        raise ValueError(f"{c} correct of {n} samples: need 0 <= correct <= samples")
    check_k(n, k)
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    # 1 - C(n-c, k) / C(n, k) as a product, exact in floating point for any n
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(keys: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> bool:
    """Whether the most common answer ``key`` among the first ``k`` samples is a correct one (None:
    an answer that could not be read, never counted; ties: the key seen first)."""
    check_k(len(keys), k)
    votes = Counter(key for key in keys[:k] if key is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(key for key in keys[:k] if key is not None and votes[key] == top)
    return any(ok for key, ok in zip(keys[:k], correct[:k], strict=True) if key == winner)


def check_k(n: int, k: int) -> None:
    """A ``ValueError`` saying what to change unless ``1 <= k <= n``."""
    if k < 1:
        raise ValueError(f"k={k}: k must be at least 1")
    if k > n:
        raise ValueError(
            f"k={k} needs at least {k} samples per prompt, and there are {n}: raise the samples (n) or lower k"
        )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean over prompts and its standard error."""

    value: float
    stderr: float

    def __str__(self) -> str:
        return f"{self.value:.4f} ± {self.stderr:.4f}"


def estimate(values: Sequence[float]) -> Estimate:
    """The mean of per-prompt ``values`` and its standard error (0 for a single prompt)."""
    array = np.asarray(values, np.float64)
    if array.size == 0:
        raise ValueError("no prompt was scored")
    stderr = float(array.std(ddof=1) / math.sqrt(array.size)) if array.size > 1 else 0.0
    return Estimate(float(array.mean()), stderr)


def score_samples(
    correct: Sequence[Sequence[bool]],
    ks: Sequence[int],
    keys: Sequence[Sequence[Hashable | None]] | None = None,
) -> dict[str, Estimate]:
    """``avg@n``, and ``pass@k`` and (with answer ``keys``) ``maj@k`` for each k of ``ks``, from
    every prompt's samples' correctness (each prompt the same number ``n`` of samples)."""
    sizes = {len(row) for row in correct}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of samples; got {sorted(sizes)}")
    (n,) = sizes
    for k in ks:
        check_k(n, k)
    out = {f"avg@{n}": estimate([sum(map(bool, row)) / n for row in correct])}
    for k in sorted(set(ks)):
        out[f"pass@{k}"] = estimate([pass_at_k(n, sum(map(bool, row)), k) for row in correct])
        if keys is not None:
            out[f"maj@{k}"] = estimate(
                [float(majority_correct(key, row, k)) for key, row in zip(keys, correct, strict=True)]
            )
    return out
