"""Reasoning evaluation of a saved model (``zaya eval PATH --task``): a task's prompts (a JSONL file
of chat records, ``{"messages": [...], "answer": ...}``, read as ``rl.prompts`` files are: a
damaged line is one error naming file and line; or a built-in task, ``add``, ``reverse``, ``sort``,
optionally ``:N`` prompts, drawn from seeds no training set of :mod:`zaya_jax.data.tasks` uses),
answered ``n`` times each and scored by :func:`zaya_jax.scoring.answers.score_answers`, the code
GRPO's held-out evaluation scores ``rl.eval_samples`` with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zaya_jax.config import ConfigError
from zaya_jax.data import tasks
from zaya_jax.objectives.rewards import read_prompt_records
from zaya_jax.scoring.answers import ScoredAnswers, score_answers

# Built-in tasks: records, and the checker they are scored with by default.
BUILTIN = {
    "add": (tasks.add_chats, "zaya_jax.rewards:math_answer"),
    "reverse": (tasks.reverse_chats, "zaya_jax.rewards:exact_match"),
    "sort": (tasks.sort_chats, "zaya_jax.rewards:exact_match"),
}
_BUILTIN_SEED = [53, 1]  # none of tasks' training or held-out draws use it


def read_task(spec: str) -> tuple[str, list[dict[str, Any]], str | None]:
    """(name, records, default checker) of ``spec``: a built-in task name (``add``, ``add:200``) or a
    JSONL file of chat records (its checker: None, the caller's choice)."""
    name, _, count = spec.partition(":")
    if name in BUILTIN and not Path(spec).exists():
        if count and not count.isdigit():
            raise ConfigError(f"--task {spec}: the count after ':' must be a number of prompts (add:200)")
        make, check = BUILTIN[name]
        return name, make(int(count or 128), seed=_BUILTIN_SEED), check
    if not Path(spec).exists():
        raise ConfigError(
            f"--task {spec}: no such file; give a JSONL file of chat records or a built-in task "
            f"({', '.join(sorted(BUILTIN))}, optionally NAME:PROMPTS)"
        )
    records = read_prompt_records(spec)[0]
    if not records:
        raise ConfigError(
            f'--task {spec}: no records; write one {{"messages": [...], "answer": ...}} per line'
        )
    return Path(spec).stem, records, None


def evaluate_reasoning(
    lm: Any,
    records: Sequence[dict[str, Any]],
    *,
    on_finish: Callable[[int, int], None] | None = None,
    **options: Any,
) -> ScoredAnswers:
    """:func:`~zaya_jax.scoring.answers.score_answers` of ``lm`` (a :class:`zaya_jax.lm.LanguageModel`
    with a tokenizer) on ``records``; ``options``: its settings (``check``, ``samples``, ``ks``,
    ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``, ``seed``, ``slots``, ``task``)."""
    if lm.tokenizer is None:
        raise ConfigError(f"a reasoning evaluation needs the model's tokenizer: {lm.tokenizer_problem}")
    return score_answers(lm.config, lm.variables, lm.tokenizer, records, on_finish=on_finish, **options)
