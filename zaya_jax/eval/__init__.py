"""Evaluation: held-out loss and perplexity of a saved model (``zaya eval``)."""

from __future__ import annotations

import itertools
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import Config, ConfigError, DataConfig, ModelConfig
from zaya_jax.data import load_tokenizer, make_row_iterator
from zaya_jax.loss import make_eval_step


class Evaluable(Protocol):
    """What evaluation needs of a model (``zaya_jax.LanguageModel`` has it)."""

    config: ModelConfig
    variables: dict[str, Any]


def evaluate(
    lm: Evaluable,
    data: DataConfig,
    *,
    split: str = "held_out",
    seq_len: int = 512,
    batch_size: int = 8,
    max_batches: int = 16,
    tokenizer: str | None = None,
) -> dict[str, Any]:
    """Mean next-token loss (nats per token) over up to ``max_batches`` batches of ``split``, read
    in order without shuffling. Returns ``{"loss", "perplexity", "tokens"}``."""
    tok = load_tokenizer(tokenizer or data.tokenizer)
    if tok.vocab_size > lm.config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary is {lm.config.vocab_size}; "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    cfg = Config(model=lm.config, data=data)
    eval_step = jax.jit(make_eval_step(cfg))
    rows = make_row_iterator(data, tok, seq_len=seq_len, seed=0, split=split, shuffle=False, repeat=False)
    total, tokens = 0.0, 0.0
    for _ in range(max_batches):
        taken = list(itertools.islice(rows, batch_size))
        if not taken:
            break
        # A short last batch is filled with empty rows (loss_mask 0): one compiled shape throughout.
        taken += [{k: np.zeros_like(v) for k, v in taken[0].items()}] * (batch_size - len(taken))
        batch = {k: jnp.asarray(np.stack([row[k] for row in taken])) for k in taken[0]}
        ce, count = eval_step(lm.variables["params"], lm.variables["balancing"], batch)
        total, tokens = total + float(ce), tokens + float(count)
    if tokens == 0:
        raise ValueError(f"no evaluation tokens: the {split!r} split of the data is empty")
    loss = total / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(tokens)}
