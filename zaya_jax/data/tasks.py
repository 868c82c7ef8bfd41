"""A built-in synthetic chat task with a deterministic, checkable answer, for post-training on the
``tiny`` model without downloads (``zaya data example-chat``), for its tests and benches, and as a
verifiable reward: the user asks to reverse a word of random lowercase letters and the answer is
that word reversed.

``reverse_chats(n, seed)`` gives the conversations, ``reverse_answer(prompt)`` the correct reply to
one, and ``exact_match(prompt, reply)`` scores a model's reply (1.0 or 0.0, surrounding whitespace
and the template's ``<|end|>`` marker ignored).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_PREFIX = "reverse: "
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def reverse_chats(n: int, seed: int = 0, min_len: int = 3, max_len: int = 6) -> list[dict[str, Any]]:
    """``n`` chat records ``{"messages": [user, assistant]}`` of the reverse task."""
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


def reverse_answer(prompt: str) -> str:
    """The correct reply to a reverse-task prompt."""
    if not prompt.startswith(_PREFIX):
        raise ValueError(f"not a reverse-task prompt (it starts with {_PREFIX!r}): {prompt!r}")
    return prompt[len(_PREFIX) :][::-1]


def exact_match(prompt: str, reply: str) -> float:
    """1.0 when ``reply`` (before any ``<|end|>``, stripped) is the correct answer, else 0.0."""
    return float(reply.split("<|end|>")[0].strip() == reverse_answer(prompt))


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> Path:
    """Chat records as a JSONL file (one object per line)."""
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
