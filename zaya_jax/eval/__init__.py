"""Evaluation: held-out loss and perplexity of a saved model (``zaya eval``): the run's own
held-out evaluation reproduced (:func:`evaluate_held_out`), or any data read in order
(:func:`evaluate`). Both run the evaluation program of :func:`zaya_jax.programs.build_programs`
on one device, the one training's held-out loss runs."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from zaya_jax.config import Config, ConfigError, DataConfig, ModelConfig
from zaya_jax.data import load_tokenizer, make_row_iterator
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.loss import average
from zaya_jax.programs import held_out_host_batches, single_device_programs


class Evaluable(Protocol):
    """What evaluation needs of a model (``zaya_jax.LanguageModel`` has it)."""

    config: ModelConfig
    variables: dict[str, Any]


def _checked(tokenizer: Tokenizer | str, lm: Evaluable) -> Tokenizer:
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if tok.vocab_size > lm.config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary is {lm.config.vocab_size}; "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    return tok


def _loss_over(
    lm: Evaluable, cfg: Config, batches: Iterable[dict[str, np.ndarray]], progress: bool
) -> dict[str, Any]:
    eval_step = single_device_programs(cfg).eval_step
    params, balancing = lm.variables["params"], lm.variables["balancing"]
    shown = tqdm(batches, unit="batch", desc="eval", disable=not progress, leave=False)
    means, weight = average(eval_step(params, balancing, jax.tree.map(jnp.asarray, b)) for b in shown)
    if weight == 0:
        raise ValueError("no evaluation tokens: the split of the data is empty")
    if cfg.train.objective != "lm":  # per pair: the preference objectives' held-out metrics
        return {**means, "pairs": int(weight)}
    return {**means, "perplexity": math.exp(means["loss"]), "tokens": int(weight)}


def evaluate(
    lm: Evaluable,
    data: DataConfig,
    *,
    split: str = "held_out",
    seq_len: int = 512,
    batch_size: int = 8,
    max_batches: int = 16,
    tokenizer: Tokenizer | str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Mean next-token loss (nats per token) over up to ``max_batches`` batches of ``split``, read
    in order without shuffling. ``tokenizer``: a tokenizer or its spec (default ``data.tokenizer``).
    Returns ``{"loss", "perplexity", "tokens"}``."""
    tok = _checked(tokenizer if tokenizer is not None else data.tokenizer, lm)
    rows = make_row_iterator(data, tok, seq_len=seq_len, seed=0, split=split, shuffle=False, repeat=False)

    def batches() -> Iterator[dict[str, np.ndarray]]:
        for _ in range(max_batches):
            taken = list(itertools.islice(rows, batch_size))
            if not taken:
                return
            # A short last batch is filled with empty rows (loss_mask 0): one compiled shape throughout.
            taken += [{k: np.zeros_like(v) for k, v in taken[0].items()}] * (batch_size - len(taken))
            yield {k: np.stack([row[k] for row in taken]) for k in taken[0]}

    return _loss_over(lm, Config(model=lm.config, data=data), batches(), progress)


def evaluate_held_out(
    lm: Evaluable,
    run_config: Config,
    *,
    tokenizer: Tokenizer | str | None = None,
    progress: bool = False,
    references: Any = None,
) -> dict[str, Any]:
    """The run's own held-out evaluation, as training computes its ``eval_loss``: the same held-out
    batches (``train.seq_len``, ``train.batch_size``, ``eval.batches``, ``train.seed``) and the
    same loss code. Returns ``{"loss", "perplexity", "tokens"}``, or for a preference run
    ``{"loss", "pair_accuracy", ..., "pairs"}`` (``references``: the run's reference
    log-probabilities, dpo and ipo)."""
    tok = _checked(tokenizer if tokenizer is not None else run_config.data.tokenizer, lm)
    cfg = dataclasses.replace(run_config, model=lm.config)
    return _loss_over(lm, cfg, held_out_host_batches(cfg, tok, references), progress)
