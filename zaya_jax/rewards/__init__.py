"""Verifiable rewards: functions ``reward(record, completion) -> float`` for ``rl.reward`` (GRPO's
rollouts and its held-out ``eval_reward``) and for evaluation, over the completion as the chat
template renders it (special tokens kept: ``"42<|im_end|>"``).

- :func:`exact_match`: 1.0 when the reply (up to its end of turn, stripped) is the record's
  reference answer, else 0.0.
- :func:`math_answer`: 1.0 when the reply's final answer equals the reference mathematically, as
  `math-verify <https://github.com/huggingface/Math-Verify>`_ decides (``\\boxed{...}``, LaTeX,
  plain numbers; ``\\frac{1}{2}``, ``0.5`` and ``1/2`` are one answer), else 0.0. A reply with no
  answer math-verify can read scores 0.0 *and* is marked unparsed (:class:`Score`), which a run
  counts apart (``reward_unparsed``, ``eval_reward_unparsed``): a model that stopped writing
  answers is not the same failure as one that writes wrong ones.
- :func:`boxed_format`: 1.0 when the reply puts one answer in ``\\boxed{...}``, else 0.0 (a format
  reward, to add to an answer reward in a function of your own).

The reference answer is the record's ``"answer"`` field, else its final assistant message
(:func:`reference_answer`). A record without one is an error the run reports with the prompt
(``rl.on_reward_error``). Answer checking is math-verify's, not ours: it is what the open reasoning
stacks (open-r1, TRL's examples, lighteval) score with, so scores compare across them; it is
imported on first use (``pip install math-verify``, in the ``rl`` and ``dev`` extras).
"""

from __future__ import annotations

import logging
import re
from typing import Any

# An end-of-turn marker as a template renders it: <|im_end|>, <|end|>, </s>, <end_of_turn> ...
_MARKER = re.compile(r"<\|?[\w/.-]+\|?>")


class Score(float):
    """A reward value that also says whether the completion held an answer the checker could read
    (``parsed``); it is a float everywhere else, and pickles as one with its flag."""

    parsed: bool

    def __new__(cls, value: float, parsed: bool = True) -> Score:
        score = super().__new__(cls, value)
        score.parsed = parsed
        return score

    def __reduce__(self):
        return (Score, (float(self), self.parsed))


def reply_text(completion: str) -> str:
    """A completion cut at its first end-of-turn marker (``<|im_end|>``, ``<|end|>``, ``</s>``,
    ``<end_of_turn>`` ...: a word of letters, digits, ``/ . -`` in ``<...>`` or ``<|...|>``),
    surrounding whitespace stripped."""
    return _MARKER.split(completion, maxsplit=1)[0].strip()


def prompt_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a model is asked to continue: the record's, without a trailing assistant one
    (the reference answer)."""
    messages = record["messages"]
    return messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages


def reference_answer(record: dict[str, Any]) -> str:
    """The record's reference answer: its ``"answer"`` field, else the content of its final
    assistant message; a ``ValueError`` naming both when it has neither."""
    if "answer" in record:
        return str(record["answer"])
    messages = record.get("messages") or []
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        return str(messages[-1].get("content", ""))
    raise ValueError(
        "the record has no reference answer: give it an 'answer' field or end its messages with the assistant's reply"
    )


def exact_match(record: dict[str, Any], completion: str) -> float:
    """1.0 when the reply (:func:`reply_text`) is the reference answer exactly (stripped), else 0.0."""
    return float(reply_text(completion) == reference_answer(record).strip())


class _NoTimeoutNotice(logging.Filter):
    """math-verify warns once that its own timeouts are off: the run's time limit replaces them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError(
            "zaya_jax.rewards:math_answer checks answers with math-verify: pip install math-verify "
            '(or pip install -e ".[rl]")'
        ) from None
    for name in ("math_verify.grader", "math_verify.parser"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _NoTimeoutNotice) for f in log.filters):
            log.addFilter(_NoTimeoutNotice())
    return math_verify


def math_answer(record: dict[str, Any], completion: str) -> Score:
    """1.0 when the reply's answer equals the reference answer mathematically (math-verify's
    ``parse`` of both, then ``verify``), else 0.0; ``parsed`` is False when the reply holds no
    answer it can read. A reference without ``$`` or ``\\boxed`` is read as one LaTeX expression
    (``2\\sqrt{2}``, not the number 2); one it cannot read is a ``ValueError`` (the record is wrong)."""
    mv = _math_verify()
    # no timeouts of math-verify's own (its SIGALRM would replace the run's): the run's
    # rl.reward_timeout bounds the whole call
    reference = reference_answer(record).strip()
    if "$" not in reference and "\\boxed" not in reference:  # the answer alone: one LaTeX expression
        reference = f"${reference}$"
    gold = mv.parse(reference, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify reads no answer in the reference {reference_answer(record)!r}")
    answer = mv.parse(reply_text(completion), parsing_timeout=None)
    if not answer:
        return Score(0.0, parsed=False)
    return Score(float(mv.verify(gold, answer, timeout_seconds=None)))


def _boxed(text: str) -> list[str]:
    """The contents of each balanced ``\\boxed{...}`` in ``text``."""
    found, start = [], 0
    while (at := text.find("\\boxed{", start)) >= 0:
        depth, i = 1, at + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append(text[at + len("\\boxed{") : i - 1])
        start = i
    return found


def boxed_format(record: dict[str, Any], completion: str) -> float:
    """1.0 when the reply (:func:`reply_text`) holds exactly one non-empty ``\\boxed{...}``, else 0.0."""
    boxed = _boxed(reply_text(completion))
    return float(len(boxed) == 1 and bool(boxed[0].strip()))
