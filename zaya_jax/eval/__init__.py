"""Evaluation: held-out loss and perplexity of a saved model (``zaya eval``): any data read in
order (:func:`evaluate`), or the run's own held-out evaluation reproduced (its objective's,
:func:`zaya_jax.objectives.held_out.evaluate_held_out`, re-exported here). Both run the evaluation
program of the run's programs on one device, the one training's held-out loss runs."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from zaya_jax.config import Config, DataConfig
from zaya_jax.data import make_row_iterator
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.objectives import Evaluable, spec_for
from zaya_jax.objectives.held_out import checked_tokenizer, evaluate_held_out, loss_over

__all__ = ["Evaluable", "evaluate", "evaluate_held_out", "ordered_batches"]


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
    rows = ordered_batches(lm, data, tokenizer, split, seq_len, batch_size, max_batches)
    cfg = Config(model=lm.config, data=data)
    return loss_over(lm, cfg, spec_for("lm").loss, rows, progress)


def ordered_batches(
    lm: Evaluable,
    data: DataConfig,
    tokenizer: Tokenizer | str | None,
    split: str,
    seq_len: int,
    batch_size: int,
    max_batches: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Up to ``max_batches`` host batches of ``split``'s packed rows, read in order without
    shuffling, tokenized by ``tokenizer`` (default ``data.tokenizer``, checked against ``lm``). A
    short last batch is filled with empty rows (loss_mask 0): one compiled shape throughout."""
    tok = checked_tokenizer(tokenizer if tokenizer is not None else data.tokenizer, lm)
    rows = make_row_iterator(data, tok, seq_len=seq_len, seed=0, split=split, shuffle=False, repeat=False)
    for _ in range(max_batches):
        taken = list(itertools.islice(rows, batch_size))
        if not taken:
            return
        taken += [{k: np.zeros_like(v) for k, v in taken[0].items()}] * (batch_size - len(taken))
        yield {k: np.stack([row[k] for row in taken]) for k in taken[0]}
