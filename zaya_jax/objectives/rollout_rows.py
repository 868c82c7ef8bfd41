"""GRPO's training rows: a sampled (or read) completion with its advantage, sampler
log-probabilities and routes placed in a row as one segment (:func:`completion_row`), or several to
a row (:func:`packed_rows`, ``rl.pack``); the fields a GRPO batch adds (:func:`rollout_fields`); the
group-normalised advantages (:func:`group_advantages`). :mod:`zaya_jax.objectives.rollouts` samples
the completions and makes each step's batch of these rows."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from zaya_jax.config import Config, ConfigError
from zaya_jax.data.batch import empty_row
from zaya_jax.loss import FieldSpec


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled (or read) completion of a prompt, ready to become a row."""

    group: Any
    prompt: np.ndarray  # prompt ids
    tokens: np.ndarray  # completion ids (the stop token included)
    logprobs: np.ndarray  # the sampler's log-probability of each completion token
    reward: float | None  # None: the reward function failed on it (rl.on_reward_error: skip)
    routes: np.ndarray | None  # (prompt + completion - 1, layers): the classes of every token read
    parsed: bool | None = None  # whether the reward read an answer (zaya_jax.rewards.Score); None: not said
    version: int | None = None  # the optimizer steps of the weights that sampled it; None: read from a file


def group_advantages(groups: list[Any], rewards: np.ndarray, scale: bool = True) -> tuple[np.ndarray, float]:
    """(reward - group mean) per completion, over the group's std when ``scale`` (0 for a group whose
    rewards are all equal), and the mean over groups of that std."""
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(json.dumps(group, sort_keys=True), []).append(i)
    advantages, stds = np.zeros(len(rewards), np.float32), []
    for indices in members.values():
        values = rewards[indices]
        stds.append(float(values.std()))
        if stds[-1] >= 1e-6:
            advantages[indices] = (values - values.mean()) / (stds[-1] if scale else 1.0)
    return advantages, float(np.mean(stds))


def needs_proximal(cfg: Config) -> bool:
    """Whether rollout rows carry the trainer's log-probabilities at the rollout's parameters
    (``proximal_logprobs``, :mod:`zaya_jax.loss.policy`): with a sampler correction when a rollout
    trains several steps (with one, the step's own parameters are the rollout's)."""
    return cfg.rl.corrected and cfg.rl.steps_per_rollout > 1


def rollout_fields(cfg: Config) -> dict[str, FieldSpec]:
    """The fields a GRPO batch adds to the text fields (:mod:`zaya_jax.data.batch`)."""
    fields: dict[str, FieldSpec] = {
        "sampler_logprobs": (np.float32, ()),
        "advantages": (np.float32, ()),
        "vocab_limit": (np.int32, ()),  # the ids the sampler could draw: the tokenizer's
    }
    if cfg.rl.kl > 0:
        fields["reference_logprobs"] = (np.float32, ())
    if needs_proximal(cfg):
        fields["proximal_logprobs"] = (np.float32, ())
    fields["routes"] = (np.int32, (cfg.model.num_layers,))
    return fields


def _empty_rollout_row(cfg: Config, pad_id: int, vocab_limit: int) -> dict[str, np.ndarray]:
    seq_len, fields = cfg.train.seq_len, rollout_fields(cfg)
    row = empty_row(seq_len, pad_id)
    for name in ("sampler_logprobs", "advantages", "reference_logprobs", "proximal_logprobs"):
        if name in fields:
            row[name] = np.zeros(seq_len, np.float32)
    row["vocab_limit"] = np.full(seq_len, vocab_limit, np.int32)
    if "routes" in fields:
        row["routes"] = np.full((seq_len, cfg.model.num_layers), -1, np.int32)
    return row


def _read_length(cfg: Config, completion: Completion) -> int:
    """The tokens a completion's segment reads (prompt + completion - 1), checked against ``train.seq_len``."""
    n = len(completion.prompt) + len(completion.tokens) - 1
    if n > cfg.train.seq_len:
        raise ConfigError(
            f"a rollout of {len(completion.prompt)} prompt + {len(completion.tokens)} completion tokens does not "
            f"fit train.seq_len={cfg.train.seq_len}; raise train.seq_len or lower rl.max_new_tokens"
        )
    return n


def _place(
    row: dict[str, np.ndarray], at: int, segment: int, completion: Completion, advantage: float
) -> int:
    """Write ``completion`` (prompt + completion, its completion's targets trained) into ``row`` as
    segment ``segment`` from position ``at``; the position after it."""
    sequence = np.concatenate([completion.prompt, completion.tokens]).astype(np.int32)
    n, first = len(sequence) - 1, at + len(completion.prompt) - 1
    end = at + n
    row["inputs"][at:end], row["targets"][at:end] = sequence[:-1], sequence[1:]
    row["segment_ids"][at:end], row["positions"][at:end] = segment, np.arange(n)
    row["loss_mask"][first:end] = 1.0
    row["sampler_logprobs"][first:end] = completion.logprobs
    row["advantages"][first:end] = advantage
    if "routes" in row and completion.routes is not None:
        row["routes"][at:end] = completion.routes[:n]
    return end


def completion_row(
    cfg: Config, completion: Completion, advantage: float, pad_id: int, vocab_limit: int
) -> dict[str, np.ndarray]:
    """One training row: prompt + completion as one segment, the completion's targets trained;
    ``vocab_limit``: the ids the sampler could draw (the tokenizer's vocabulary)."""
    _read_length(cfg, completion)
    row = _empty_rollout_row(cfg, pad_id, vocab_limit)
    _place(row, 0, 1, completion, advantage)
    return row


def packed_rows(
    cfg: Config,
    completions: list[Completion],
    advantages: np.ndarray,
    pad_id: int,
    vocab_limit: int,
    multiple: int = 1,
) -> list[dict[str, np.ndarray]]:
    """The completions packed several to a row of ``train.seq_len`` (``rl.pack``), each its own
    segment (attention, positions and the loss's per-completion sums stay within it): first fit,
    longest first, so the rows are as few as that greedy packing makes them; the row count rounded
    up to a multiple of ``multiple`` (or to ``train.batch_size``, where that is fewer) with empty
    rows (the step's batch must split evenly)."""
    lengths = [_read_length(cfg, c) for c in completions]
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(completions)), key=lambda i: (-lengths[i], i)):
        slot = next((b for b, room in enumerate(free) if room >= lengths[i]), None)
        if slot is None:
            bins.append([])
            free.append(cfg.train.seq_len)
            slot = len(bins) - 1
        bins[slot].append(i)
        free[slot] -= lengths[i]
    rows = []
    for members in bins:
        row, at = _empty_rollout_row(cfg, pad_id, vocab_limit), 0
        for segment, i in enumerate(sorted(members), start=1):
            at = _place(row, at, segment, completions[i], float(advantages[i]))
        rows.append(row)
    target = len(rows) + -len(rows) % multiple
    if target > cfg.train.batch_size >= len(rows):  # train.batch_size splits evenly too
        target = cfg.train.batch_size
    rows += [_empty_rollout_row(cfg, pad_id, vocab_limit) for _ in range(target - len(rows))]
    return rows
