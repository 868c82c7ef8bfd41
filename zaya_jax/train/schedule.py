"""The checks before a run (its objective's, the tokenizer against the model, settings that are
valid but almost certainly not meant) and the batch size the learning rates are set for. What each
step trains on is the objective's producer's (:mod:`zaya_jax.objectives`; the batch ramp and
curriculum: :func:`zaya_jax.objectives.lm.plan_for`)."""

from __future__ import annotations

import warnings

from zaya_jax import objectives
from zaya_jax.config import Config, ConfigError
from zaya_jax.data import load_tokenizer
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.train.init import check_source


def check_run(cfg: Config) -> Tokenizer:
    """The checks before a run, returning its tokenizer: the objective's checks
    (:func:`zaya_jax.objectives.check`), an error when the tokenizer's ids do not fit the model's
    vocabulary, a warning for each of :func:`plan_warnings`."""
    objectives.check(cfg)
    check_source(cfg)
    for warning in plan_warnings(cfg):
        warnings.warn(warning, stacklevel=3)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size}"
        )
    return tokenizer


def plan_warnings(cfg: Config) -> list[str]:
    """Settings that are valid but almost certainly not meant (the run still starts)."""
    out = []
    if cfg.optim.warmup_steps >= cfg.train.steps:
        out.append(
            f"optim.warmup_steps={cfg.optim.warmup_steps} >= train.steps={cfg.train.steps}: the learning rate "
            "never reaches its peak; lower optim.warmup_steps"
        )
    return out


def final_batch_size(cfg: Config) -> int:
    """The batch size at the end of the ramp (the one the learning rates are set for)."""
    return cfg.train.batch_ramp[-1].batch_size if cfg.train.batch_ramp else cfg.train.batch_size


def largest_step(cfg: Config) -> tuple[int, int, int]:
    """(rows, sequence length, curriculum stage) of the run's largest step in tokens: the final
    batch size (or a stage's own) at each stage's row length, the longest rows among the largest."""
    final = final_batch_size(cfg)
    shapes = [(final, cfg.train.seq_len, 0)] if not cfg.train.stages else []
    shapes += [(s.batch_size or final, s.seq_len, i) for i, s in enumerate(cfg.train.stages)]
    return max(shapes, key=lambda shape: (shape[0] * shape[1], shape[1], -shape[2]))
