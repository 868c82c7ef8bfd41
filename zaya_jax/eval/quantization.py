"""What quantizing the experts does to a model (``zaya eval PATH --quantize fp8-experts``): the
quantized export against the bfloat16 export of the same weights, on held-out tokens read in order.

Both models are what their exports hold: every weight rounded to bfloat16 (the balancing biases
kept in float32), and for the quantized one the experts instead quantized from the model's own
weights (``model.expert_quantization``, the rules of :mod:`zaya_jax.ops.quantization`). One forward
pass of each per batch gives

* the held-out loss of each and its change;
* greedy agreement: the share of positions whose most likely next token is the same in both;
* per layer, the share of tokens routed to another class (an expert or the skip class), and each
  model's share routed to the skip class. A top-1 router moves a token whole when quantization moves
  its scores past the margin between its two best classes; the first layer's router reads no
  expert's output, so only layers after it can move;
* the size of both exports' tensors (:func:`zaya_jax.interop.hf.quantized.export_bytes`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import ModelConfig
from zaya_jax.interop.hf.quantized import KINDS, export_bytes
from zaya_jax.loss import token_nll
from zaya_jax.model import BALANCING, Zaya
from zaya_jax.model.lowrank import merged
from zaya_jax.model.transformer import lm_head_weights
from zaya_jax.objectives import Evaluable

ARGMAX_CHUNK = 512  # positions whose logits are held at once for the greedy token


@functools.cache
def _program(cfg: ModelConfig) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """``(variables, batch) -> (nll, greedy, choice)``: (batch, seq) losses and most likely next
    tokens, and (layers, batch, seq) each layer's chosen class."""
    model = Zaya(cfg)

    def run(variables: dict[str, Any], batch: dict[str, jax.Array]):
        nll = token_nll(model, variables["params"], variables[BALANCING], batch)[0]
        (hidden, _), state = model.apply(
            variables,
            batch["inputs"],
            token_mask=batch["segment_ids"] > 0,
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
            return_hidden=True,
            mutable=["intermediates"],
        )
        choice = state["intermediates"]["layers"]["router_choice"][0]
        return nll, _greedy(cfg, variables["params"], hidden), choice

    return jax.jit(run)


def _greedy(cfg: ModelConfig, params: dict[str, Any], hidden: jax.Array) -> jax.Array:
    """The most likely next token at every position, ``ARGMAX_CHUNK`` positions' logits at a time."""
    weight, bias, vocab_axis = lm_head_weights(cfg, params)
    batch, seq, width = hidden.shape
    flat = hidden.reshape(-1, width)
    pad = -flat.shape[0] % ARGMAX_CHUNK
    chunks = jnp.pad(flat, ((0, pad), (0, 0))).reshape(-1, ARGMAX_CHUNK, width)

    def best(chunk: jax.Array) -> jax.Array:
        spec = "ph,vh->pv" if vocab_axis == 0 else "ph,hv->pv"
        logits = jnp.einsum(spec, chunk, weight, preferred_element_type=jnp.float32)
        return jnp.argmax(logits if bias is None else logits + bias.astype(jnp.float32), axis=-1)

    return jax.lax.map(best, chunks).reshape(-1)[: batch * seq].reshape(batch, seq)


def exported_variables(variables: dict[str, Any], *, keep_experts: bool) -> dict[str, Any]:
    """``variables`` as a bfloat16 export holds them: low-rank adapters merged (as exports merge
    them), every parameter rounded to bfloat16 (in its own dtype), the balancing biases as they are; ``keep_experts``: the experts unrounded, as a
    quantized export quantizes them from the model's own values."""

    def rounded(path: tuple[Any, ...], leaf: jax.Array) -> jax.Array:
        keys = [getattr(p, "key", "") for p in path]
        if keep_experts and "experts" in keys:
            return leaf
        return jnp.asarray(leaf).astype(jnp.bfloat16).astype(leaf.dtype)

    params = jax.tree_util.tree_map_with_path(rounded, merged(variables["params"]))
    return {**variables, "params": params}


def quantization_report(
    lm: Evaluable, quantize: str, batches: Iterable[dict[str, np.ndarray]]
) -> dict[str, Any]:
    """The quantized export of ``lm`` (``quantize``: ``fp8-experts`` or ``mxfp4-experts``) against
    its bfloat16 export, over host ``batches`` (``inputs``, ``targets``, ``loss_mask``,
    ``segment_ids``, ``positions``; :func:`zaya_jax.eval.ordered_batches` reads a split in order)."""
    if quantize not in KINDS:
        raise ValueError(f"--quantize {quantize!r} is not one of {', '.join(KINDS)}")
    if lm.config.expert_quantization != "none":
        raise ValueError(
            f"the model's experts are {lm.config.expert_quantization} already (model.expert_quantization): "
            "compare quantized exports against the bfloat16 model they were made from"
        )
    kind = KINDS[quantize]
    programs = {
        "bfloat16": (_program(lm.config), exported_variables(lm.variables, keep_experts=False)),
        quantize: (
            _program(dataclasses.replace(lm.config, expert_quantization=kind)),
            exported_variables(lm.variables, keep_experts=True),
        ),
    }
    layers = lm.config.num_layers
    loss = {name: 0.0 for name in programs}
    skipped = {name: np.zeros(layers) for name in programs}
    tokens, agreed, routed_tokens = 0, 0, 0
    moved = np.zeros(layers)
    for batch in batches:
        device = {k: jnp.asarray(v) for k, v in batch.items()}
        out = {name: [np.asarray(x) for x in run(v, device)] for name, (run, v) in programs.items()}
        kept = batch["loss_mask"] > 0
        routed = batch["segment_ids"] > 0
        tokens += int(kept.sum())
        routed_tokens += int(routed.sum())
        agreed += int((out["bfloat16"][1] == out[quantize][1])[kept].sum())
        moved += ((out["bfloat16"][2] != out[quantize][2]) & routed).sum(axis=(1, 2))
        for name, (nll, _, choice) in out.items():
            loss[name] += float(nll[kept].sum())
            skipped[name] += ((choice == lm.config.num_experts) & routed).sum(axis=(1, 2))
    if not tokens:
        raise ValueError("no evaluation tokens: the batches hold no trained target")
    return _report(lm.config, quantize, loss, skipped, moved, tokens, agreed, routed_tokens)


def _report(
    cfg: ModelConfig,
    quantize: str,
    loss: dict[str, float],
    skipped: dict[str, np.ndarray],
    moved: np.ndarray,
    tokens: int,
    agreed: int,
    routed: int,
) -> dict[str, Any]:
    sizes = {"bfloat16": export_bytes(cfg)["total"], quantize: export_bytes(cfg, KINDS[quantize])["total"]}
    means = {name: total / tokens for name, total in loss.items()}
    return {
        "quantize": quantize,
        "tokens": tokens,
        "bytes": sizes,
        "size_ratio": sizes[quantize] / sizes["bfloat16"],
        "loss": means,
        "loss_change": means[quantize] - means["bfloat16"],
        "greedy_agreement": agreed / tokens,
        "route_change": float(moved.sum() / (routed * cfg.num_layers)),
        "route_change_by_layer": [float(m / routed) for m in moved],
        "skip_share_by_layer": {name: [float(s / routed) for s in skipped[name]] for name in skipped},
    }
