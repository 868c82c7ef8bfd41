"""A built-in synthetic chat task with a deterministic, checkable answer, for post-training on the
``tiny`` model without downloads (``zaya data example-chat``, ``example-preference``), for its tests
and benches, and as a verifiable reward: the user asks to reverse a word of random lowercase letters
and the answer is that word reversed.

``reverse_chats(n, seed)`` gives the conversations, ``reverse_answer(prompt)`` the correct reply to
one, and ``exact_match(prompt, reply)`` scores a model's reply (1.0 or 0.0, surrounding whitespace
and the template's end-of-turn marker, ``<|end|>`` or a tokenizer's ``<|im_end|>``, ignored). ``reverse_pairs(n, seed)`` gives preference pairs
(chosen: the reversed word; rejected: the word copied unchanged), and :func:`reverse_reward` is the
GRPO reward function (``rl.reward``) of the task.

A second task, for GRPO on a task it was not tuned on (``bench/grpo_chat.py``): ``sort_chats(n,
seed)`` asks to sort random letters, and :func:`sort_reward` gives partial credit (the fraction of
characters in place). A third, with an answer checked mathematically: ``add_chats(n, seed)`` asks
for a sum (``"add: 17+28"`` -> ``"45"``), scored by :func:`zaya_jax.rewards.math_answer`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zaya_jax.rewards import reply_text

_PREFIX = "reverse: "
_SORT_PREFIX = "sort: "
_ADD_PREFIX = "add: "
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def reverse_chats(
    n: int, seed: int | Sequence[int] = 0, min_len: int = 3, max_len: int = 6
) -> list[dict[str, Any]]:
    """``n`` chat records ``{"messages": [user, assistant]}`` of the reverse task (``seed``: any
    ``numpy.random.default_rng`` seed)."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        word = "".join(rng.choice(_LETTERS, size=int(rng.integers(min_len, max_len + 1))))
        prompt = _PREFIX + word
        records.append(
            {
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": reverse_answer(prompt)},
                ]
            }
        )
    return records


def reverse_pairs(n: int, seed: int = 0, min_len: int = 3, max_len: int = 6) -> list[dict[str, Any]]:
    """``n`` preference records ``{"prompt", "chosen", "rejected"}``: the reversed word is preferred
    to the word copied unchanged (palindromes, which would make both the same, are not drawn)."""
    pairs = []
    for record in reverse_chats(2 * n + 16, seed, min_len, max_len):
        prompt, answer = (m["content"] for m in record["messages"])
        if answer != prompt[len(_PREFIX) :]:
            pairs.append({"prompt": prompt, "chosen": answer, "rejected": prompt[len(_PREFIX) :]})
        if len(pairs) == n:
            return pairs
    raise ValueError(f"could not draw {n} non-palindromes; raise max_len")


def reverse_reward(record: dict[str, Any], completion: str) -> float:
    """The reverse task's reward for ``completion`` of ``record``'s prompt (its first user message):
    1.0 for the exact reversed word (:func:`exact_match`), else 0.0."""
    prompt = next(m["content"] for m in record["messages"] if m["role"] == "user")
    return exact_match(prompt, completion)


def reverse_answer(prompt: str) -> str:
    """The correct reply to a reverse-task prompt."""
    if not prompt.startswith(_PREFIX):
        raise ValueError(f"not a reverse-task prompt (it starts with {_PREFIX!r}): {prompt!r}")
    return prompt[len(_PREFIX) :][::-1]


def exact_match(prompt: str, reply: str) -> float:
    """1.0 when ``reply`` (before any end-of-turn marker, stripped: :func:`zaya_jax.rewards.reply_text`) is the
    correct answer, else 0.0."""
    return float(reply_text(reply) == reverse_answer(prompt))


def sort_chats(
    n: int, seed: int | Sequence[int] = 0, min_len: int = 3, max_len: int = 7
) -> list[dict[str, Any]]:
    """``n`` chat records of the sort task: the user asks to sort random lowercase letters
    (``"sort: qbxa"``) and the assistant answers them in alphabetical order (``"abqx"``)."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        word = "".join(rng.choice(_LETTERS, size=int(rng.integers(min_len, max_len + 1))))
        records.append(
            {
                "messages": [
                    {"role": "user", "content": _SORT_PREFIX + word},
                    {"role": "assistant", "content": "".join(sorted(word))},
                ]
            }
        )
    return records


def sort_reward(record: dict[str, Any], completion: str) -> float:
    """The sort task's partial-credit reward: the characters of the reply (:func:`~zaya_jax.rewards.reply_text`: up
    to the end of turn) equal to the sorted letters at the same position, over the longer of the
    two (1.0 exactly for the right answer; a reply cut at ``rl.max_new_tokens`` before its end of
    turn is scored whole, so what follows the answer costs credit)."""
    prompt = next(m["content"] for m in record["messages"] if m["role"] == "user")
    if not prompt.startswith(_SORT_PREFIX):
        raise ValueError(f"not a sort-task prompt (it starts with {_SORT_PREFIX!r}): {prompt!r}")
    answer, reply = "".join(sorted(prompt[len(_SORT_PREFIX) :])), reply_text(completion)
    return sum(a == b for a, b in zip(answer, reply, strict=False)) / max(len(answer), len(reply), 1)


def add_chats(n: int, seed: int | Sequence[int] = 0, low: int = 0, high: int = 99) -> list[dict[str, Any]]:
    """``n`` chat records of the addition task: the user asks for the sum of two integers in [low,
    high] (``"add: 17+28"``) and the assistant answers it (``"45"``); the record's ``answer``
    field holds it too, for :func:`zaya_jax.rewards.math_answer`."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(low, high + 1, size=2))
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"{_ADD_PREFIX}{a}+{b}"},
                    {"role": "assistant", "content": str(a + b)},
                ],
                "answer": str(a + b),
            }
        )
    return records


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> Path:
    """Chat records as a JSONL file (one object per line)."""
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
