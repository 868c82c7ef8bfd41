"""n sampled answers to each prompt, checked and scored: pass@k, avg@n, maj@k with standard errors
(:mod:`zaya_jax.scoring.metrics`), with the failures that silently move such scores counted apart:
answers cut by the token budget (``truncated``: no stop token within ``max_new_tokens``) and answers
no answer could be read from (``unparsed``: a checker's :class:`zaya_jax.rewards.Score` marked so,
or a reasoning block that never closed).

Each prompt is rendered with the tokenizer's chat template and sampled ``n`` times through the
rollout engine (a prompt read once for its ``n`` samples), each stopping where GRPO's rollouts stop
(:func:`zaya_jax.data.chat.rollout_stop_ids`: the model's and tokenizer's EOS,
``generation_config.json``'s and the template's end of turn). Reasoning blocks
(``<think>...</think>``) are removed before the checker reads an answer; a block left open is an
answer that never came. The checker is a reward function (``module:function``, as ``rl.reward``:
:func:`zaya_jax.rewards.math_answer`, :func:`~zaya_jax.rewards.exact_match`, or a user's), an
answer correct when it scores 1.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zaya_jax.config import Config, ModelConfig
from zaya_jax.data.chat import ChatEncoder, rollout_stop_ids, tokenizer_chat_template
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.engine import Engine, Request
from zaya_jax.files import write_atomic
from zaya_jax.rewards import Score, prompt_messages, reference_answer, reply_text
from zaya_jax.rewards.calls import RewardFunction
from zaya_jax.scoring.metrics import Estimate, check_k, estimate, score_samples

_THINK = re.compile(r"<think>.*?</think>", re.S)
_BOXED = re.compile(r"\\boxed\{")


def strip_reasoning(text: str) -> tuple[str, bool]:
    """(``text`` without its closed ``<think>...</think>`` blocks, whether a block was left open:
    then everything from its ``<think>`` is reasoning, and no answer follows)."""
    text = _THINK.sub("", text)
    opened = text.find("<think>")
    return (text[:opened], True) if opened >= 0 else (text, False)


def answer_key(reply: str) -> str:
    """What majority voting groups answers by: the last ``\\boxed{...}``'s content if the reply has
    one, else the reply, with whitespace removed."""
    starts = [m.end() for m in _BOXED.finditer(reply)]
    if starts:
        depth, i = 1, starts[-1]
        while i < len(reply) and depth:
            depth += {"{": 1, "}": -1}.get(reply[i], 0)
            i += 1
        reply = reply[starts[-1] : i - 1]
    return "".join(reply.split())


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sampled answer: its prompt's and its own index, the completion as the template renders it
    (special tokens kept), the score the checker gave, whether it counts as correct (score 1),
    whether an answer could be read (False: the checker found none, or a reasoning block never
    closed; a checker that does not say reads every answer), whether the token budget cut it, and
    its length in tokens."""

    prompt: int
    sample: int
    completion: str
    score: float
    correct: bool
    parsed: bool
    truncated: bool
    tokens: int
    key: str | None  # what majority voting groups it by (None: no answer read)


@dataclasses.dataclass
class ScoredAnswers:
    """A task's scores: ``metrics`` (pass@k, avg@n, maj@k, ``score``: the mean checker score), the
    shares of samples ``truncated`` and ``unparsed``, and every sample."""

    task: str
    metrics: dict[str, Estimate]
    truncated: float
    unparsed: float
    samples: list[Sample]
    settings: dict[str, Any]
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """The scores as JSON: each metric's value and standard error, the shares, the settings."""
        return {
            "task": self.task,
            "prompts": len({s.prompt for s in self.samples}),
            "metrics": list(self.metrics),
            **{name: e.value for name, e in self.metrics.items()},
            **{f"{name}_stderr": e.stderr for name, e in self.metrics.items()},
            "truncated": self.truncated,
            "unparsed": self.unparsed,
            "settings": self.settings,
        }

    def write(self, directory: str | Path) -> Path:
        """``scores.json`` and ``samples.jsonl`` (one line per sample: the prompt's messages, the
        reference answer, the completion and its verdict) in ``directory``; returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lines = []
        for s in self.samples:
            record = self.records[s.prompt] if self.records else None
            context = {"messages": prompt_messages(record), "answer": _answer(record)} if record else {}
            lines.append(json.dumps({**context, **dataclasses.asdict(s)}) + "\n")
        write_atomic(directory / "samples.jsonl", "".join(lines))
        write_atomic(directory / "scores.json", json.dumps(self.summary(), indent=2) + "\n")
        return directory


def _answer(record: dict[str, Any]) -> str | None:
    try:
        return reference_answer(record)
    except ValueError:
        return None


def score_answers(
    model: ModelConfig,
    variables: dict[str, Any],
    tokenizer: Tokenizer,
    records: Sequence[dict[str, Any]],
    *,
    check: str | RewardFunction,
    samples: int = 8,
    ks: Sequence[int] = (1,),
    temperature: float = 0.6,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 512,
    seed: int = 0,
    slots: int = 64,
    task: str = "task",
    check_timeout: float = 30.0,
    on_finish: Callable[[int, int], None] | None = None,
) -> ScoredAnswers:
    """Sample ``samples`` answers to each record's prompt from the model (``model``, ``variables``,
    its ``tokenizer``), check each with the reward function
    ``check`` (``module:function``, each call held to ``check_timeout`` seconds; one that fails
    stops the evaluation naming the prompt; or a run's :class:`RewardFunction` with its own error
    policy, a skipped answer scoring 0, unparsed) and score them. ``ks``: the k of pass@k and maj@k (each
    at most ``samples``); ``temperature`` 0 samples greedily (every sample the same). Sample j of
    prompt i draws from the random stream ``i * samples + j`` of ``seed``, whatever ``slots``.
    ``on_finish(done, total)`` reports progress."""
    for k in ks:  # refused before anything is sampled
        check_k(samples, k)
    checker = RewardFunction(check, "stop", check_timeout) if isinstance(check, str) else check
    settings = {"samples": samples, "ks": sorted(set(ks)), "temperature": temperature, "top_p": top_p,
                "top_k": top_k, "max_new_tokens": max_new_tokens, "seed": seed, "check": checker.spec}  # fmt: skip
    requests = _requests(model, tokenizer, records, settings)
    done = [0]

    def finished(_index: int, _result: Any) -> None:
        done[0] += 1
        if on_finish is not None:
            on_finish(done[0], len(requests))

    try:
        engine = Engine(
            model, variables, slots=slots, vocab_limit=tokenizer.vocab_size, decode=tokenizer.decode
        )
        results = engine.run(requests, finished)
        out = _judged(tokenizer, records, results, samples, checker)
    finally:
        if checker is not check:
            checker.close()
    correct = [[s.correct for s in out[i * samples : (i + 1) * samples]] for i in range(len(records))]
    keys = [[s.key for s in out[i * samples : (i + 1) * samples]] for i in range(len(records))]
    metrics = score_samples(correct, ks, keys)
    metrics["score"] = estimate([float(np.mean([s.score for s in out[i * samples : (i + 1) * samples]]))
                                 for i in range(len(records))])  # fmt: skip
    return ScoredAnswers(
        task=task,
        metrics=metrics,
        truncated=float(np.mean([s.truncated for s in out])),
        unparsed=float(np.mean([not s.parsed for s in out])),
        samples=out,
        settings=settings,
        records=list(records),
    )


def _requests(
    model: ModelConfig, tok: Tokenizer, records: Sequence[dict[str, Any]], settings: dict[str, Any]
) -> list[Request]:
    """Each record's prompt, rendered with the tokenizer's chat template, ``samples`` times."""
    chat = ChatEncoder(tok, tokenizer_chat_template(tok))
    stops = rollout_stop_ids(Config(model=model), tok, chat)
    requests = []
    for i, record in enumerate(records):
        prompt = tok.encode(chat.prompt(prompt_messages(record), record.get("tools"))).tolist()
        for j in range(settings["samples"]):
            requests.append(
                Request(
                    prompt,
                    settings["max_new_tokens"],
                    settings["temperature"],
                    settings["top_k"],
                    settings["top_p"],
                    seed=settings["seed"],
                    stream=i * settings["samples"] + j,
                    stop_tokens=stops,
                )
            )
    return requests


def _judged(
    tok: Any, records: Sequence[dict[str, Any]], results: Sequence[Any], samples: int, checker: RewardFunction
) -> list[Sample]:
    """Every result decoded (special tokens kept), its reasoning removed, and checked."""
    texts = [tok.decode(r.tokens.tolist(), skip_special_tokens=False) for r in results]
    answers = [strip_reasoning(text) for text in texts]
    owners = [records[index // samples] for index in range(len(results))]
    values = checker.score(owners, [answer for answer, _ in answers])
    out = []
    for index, (result, text, (answer, unfinished), value) in enumerate(
        zip(results, texts, answers, values, strict=True)
    ):
        value = Score(0.0, parsed=False) if unfinished or value is None else value
        parsed = bool(getattr(value, "parsed", True))
        key = answer_key(reply_text(answer)) if parsed else None
        prompt, sample = divmod(index, samples)
        out.append(Sample(prompt, sample, text, float(value), float(value) >= 1.0, parsed,
                          not result.stopped, len(result.tokens), key))  # fmt: skip
    return out
