"""Did a context extension work: passkey retrieval at chosen lengths and depths
(:func:`passkey_accuracy`, ``zaya eval PATH --passkey 512,2048``) and the held-out loss by position
in the document (:func:`loss_by_position`, ``zaya eval PATH --by-position 8``).

A passkey check is scored by one forward pass: the key's tokens are fed after the question and a
check passes when the model's most likely next token is the key's at every one of them. That is
exactly whether greedy decoding would write the key (greedy decoding takes the most likely token at
each step; the first wrong one is where the two would part), without a decode loop, and only the
answer's positions go through the LM head, so a long check at a 262k vocabulary holds no
(length x vocabulary) logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import DataConfig, ModelConfig
from zaya_jax.data.passkey import passkey_prompt, random_filler, random_key
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.eval import ordered_batches
from zaya_jax.loss import token_nll
from zaya_jax.model import BALANCING, Zaya
from zaya_jax.model.transformer import lm_head_weights
from zaya_jax.objectives import Evaluable

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@functools.cache
def _answer_program(cfg: ModelConfig, answer: int) -> Callable[..., jax.Array]:
    """``(variables, ids) -> (batch, answer)`` the most likely token after each of the ``answer``
    positions before the last (what predicts the answer's tokens)."""
    model = Zaya(cfg)

    def run(variables: dict[str, Any], ids: jax.Array) -> jax.Array:
        hidden, _ = model.apply(variables, ids, return_hidden=True)
        weight, bias, vocab_axis = lm_head_weights(cfg, variables["params"])
        picked = hidden[:, -answer - 1 : -1]
        spec = "bah,vh->bav" if vocab_axis == 0 else "bah,hv->bav"
        logits = jnp.einsum(spec, picked, weight, preferred_element_type=jnp.float32)
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        return jnp.argmax(logits, axis=-1)

    return jax.jit(run)


def passkey_accuracy(
    lm: Evaluable,
    tokenizer: Tokenizer,
    length: int,
    *,
    depths: Sequence[float] = DEPTHS,
    prompts: int = 10,
    batch_size: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """The share of ``prompts`` passkey checks of ``length`` tokens per depth that the model
    answers exactly: ``{"length", "accuracy", "by_depth": {depth: accuracy}, "checks"}``. Keys are
    drawn from ``seed`` (the same checks on every model)."""
    if prompts < 1 or batch_size < 1:
        raise ValueError(f"need at least one prompt and a batch of one (got {prompts} and {batch_size})")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"passkey depths are fractions of the filler in [0, 1]; got {list(depths)}")
    rng = np.random.default_rng([seed, length])
    checks = [
        (d, *passkey_prompt(tokenizer, length, d, random_key(rng), random_filler(rng)))
        for d in depths
        for _ in range(prompts)
    ]
    passed = answered(lm, [(ids, n) for _, ids, n in checks], batch_size)
    by_depth = {
        f"{d:g}": float(np.mean([ok for (depth, _, _), ok in zip(checks, passed, strict=True) if depth == d]))
        for d in depths
    }
    return {"length": length, "accuracy": float(np.mean(passed)), "by_depth": by_depth, "checks": len(checks)}


def answered(lm: Evaluable, checks: Sequence[tuple[np.ndarray, int]], batch_size: int = 8) -> list[bool]:
    """For each ``(ids, n)`` of one length: whether greedy decoding from ``ids[:-n]`` writes
    ``ids[-n:]`` (the most likely token after each of the ``n`` positions before the last is the
    one that follows it)."""
    answer = max(n for _, n in checks)
    program = _answer_program(lm.config, answer)
    passed = []
    for start in range(0, len(checks), batch_size):
        chunk = list(checks[start : start + batch_size])
        ids = np.stack([ids for ids, _ in chunk] + [chunk[0][0]] * (batch_size - len(chunk)))
        guess = np.asarray(program(lm.variables, jnp.asarray(ids)))
        for row, (prompt, n) in enumerate(chunk):
            passed.append(bool((guess[row, answer - n :] == prompt[-n:]).all()))
    return passed


@functools.cache
def _nll_program(cfg: ModelConfig) -> Callable[..., jax.Array]:
    model = Zaya(cfg)

    def run(variables: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        return token_nll(model, variables["params"], variables[BALANCING], batch)[0]

    return jax.jit(run)


def loss_by_position(
    lm: Evaluable,
    data: DataConfig,
    *,
    buckets: int,
    seq_len: int = 512,
    batch_size: int = 8,
    max_batches: int = 16,
    tokenizer: Tokenizer | str | None = None,
    split: str = "held_out",
) -> dict[str, Any]:
    """The next-token loss of ``split`` (read in order, as :func:`zaya_jax.eval.evaluate` reads it)
    by the target's position in its document, in ``buckets`` equal spans of ``[0, seq_len)``:
    ``{"loss", "tokens", "by_position": [{"from", "to", "loss", "tokens"}]}`` (a bucket without
    tokens has loss None). A model that uses a longer context has a lower loss late in a document."""
    if buckets < 1 or buckets > seq_len:
        raise ValueError(f"--by-position takes 1 to seq_len={seq_len} buckets, got {buckets}")
    edges = np.linspace(0, seq_len, buckets + 1).astype(int)
    sums, counts = np.zeros(buckets), np.zeros(buckets, np.int64)
    program = _nll_program(lm.config)
    for batch in ordered_batches(lm, data, tokenizer, split, seq_len, batch_size, max_batches):
        nll = np.asarray(program(lm.variables, {k: jnp.asarray(v) for k, v in batch.items()}))
        kept = batch["loss_mask"] > 0
        where = np.searchsorted(edges, batch["positions"][kept], side="right") - 1
        sums += np.bincount(where, weights=nll[kept], minlength=buckets)
        counts += np.bincount(where, minlength=buckets)
    if not counts.sum():
        raise ValueError("no evaluation tokens: the split of the data is empty")
    spans = [
        {"from": int(lo), "to": int(hi), "loss": float(s / c) if c else None, "tokens": int(c)}
        for lo, hi, s, c in zip(edges[:-1], edges[1:], sums, counts, strict=True)
    ]
    return {"loss": float(sums.sum() / counts.sum()), "tokens": int(counts.sum()), "by_position": spans}
