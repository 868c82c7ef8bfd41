"""Rollouts from files (``rl.rollouts``): JSONL records, one completion each, ``{"group": any JSON
value naming the prompt's group, "prompt_ids": [...], "completion_ids": [...], "logprobs": [...]
(one per completion token, under the distribution sampled: ``rl.temperature``, ``rl.top_k``,
``rl.top_p`` over the tokenizer's vocabulary, as vLLM's ``logprobs_mode="processed_logprobs"``
gives them), "reward": float}`` and optionally the routes the
sampler took, for router replay, for every token read (``len(prompt_ids) + len(completion_ids) -
1`` of them: every token but the last), in one of two layouts:

- zaya's: ``"routes": [[class per layer] per token read]``, a class being an expert index in
  [0, E), E (``model.num_experts``) for the skip class, or -1 where unknown (the router chooses);
- vLLM's capture (vllm-project/vllm#28284): ``"routed_experts": [[[expert] per layer] per token
  read]`` (shape tokens read x layers x top_k, top_k = 1 for ZAYA) with ``"routed_skip": [[bool
  per layer] per token read]``, true where the router chose the skip class. vLLM (upstream and
  Zyphra's ``zaya.py``) rewrites a skip choice to expert 0 with weight 0 before its fused MoE, so
  ``routed_experts`` alone cannot tell a skipped token from one routed to expert 0; every ZAYA
  router has the skip class, so a record with ``routed_experts`` and no ``routed_skip`` is refused
  (drop both to let the trainer's router choose). The mask's tokens become class E.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from zaya_jax.config import Config, ModelConfig
from zaya_jax.data import BadDocuments, DataError, jsonl_records
from zaya_jax.objectives.rollout_rows import Completion


def read_rollout_files(cfg: Config) -> list[Completion]:
    """Every record of ``rl.rollouts``, checked (see the module doc for the format)."""
    out = []
    for _, where, record in jsonl_records(cfg.rl.rollouts, BadDocuments("error"), name="rollouts"):
        try:
            out.append(_completion_from_record(record, cfg.model))
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(
                f"{where}: not a rollout record ({err}); see zaya_jax.objectives.rollout_files for the format"
            ) from None
    if not out:
        raise DataError(f"rl.rollouts={cfg.rl.rollouts} holds no rollout records")
    print(f"zaya train: {len(out)} rollouts read from {cfg.rl.rollouts}", file=sys.stderr)
    return out


def _token_ids(value: Any, name: str, vocab: int) -> np.ndarray:
    ids = np.asarray(value)
    if ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a non-empty list of token ids")
    bad = ids[(ids < 0) | (ids >= vocab)]
    if len(bad):
        raise ValueError(f"{name} holds id {int(bad[0])}, outside the model's vocabulary [0, {vocab})")
    return ids.astype(np.int32)


def _completion_from_record(record: dict[str, Any], model: ModelConfig) -> Completion:
    prompt = _token_ids(record["prompt_ids"], "prompt_ids", model.vocab_size)
    tokens = _token_ids(record["completion_ids"], "completion_ids", model.vocab_size)
    logprobs = np.asarray(record["logprobs"], np.float32)
    if logprobs.shape != tokens.shape:
        raise ValueError(f"{len(logprobs)} logprobs for {len(tokens)} completion tokens")
    if not np.isfinite(logprobs).all() or logprobs.max() > 1e-4:
        raise ValueError("logprobs must be finite log-probabilities (<= 0)")
    reward = float(record["reward"])
    if not math.isfinite(reward):
        raise ValueError(f"reward {reward} is not a finite number")
    routes = _routes_from_record(record, model, len(prompt) + len(tokens) - 1)
    return Completion(record["group"], prompt, tokens, logprobs, reward, routes)


def _routes_from_record(record: dict[str, Any], model: ModelConfig, read: int) -> np.ndarray | None:
    """The record's routes as zaya classes, (tokens read, layers), or None: ``routes`` as they are,
    or vLLM's ``routed_experts`` with its ``routed_skip`` mask converted (skip -> E)."""
    layers, experts = model.num_layers, model.num_experts
    given = [name for name in ("routes", "routed_experts") if record.get(name) is not None]
    if len(given) == 2:
        raise ValueError("routes and routed_experts are two layouts of the same routes: give one")
    if record.get("routed_skip") is not None and given != ["routed_experts"]:
        raise ValueError("routed_skip is the skip mask of routed_experts, which the record lacks")
    if not given:
        return None
    if given == ["routes"]:
        routes = np.asarray(record["routes"])
        if routes.shape != (read, layers):
            raise ValueError(
                f"routes have shape {routes.shape}, expected {(read, layers)} (tokens read x layers)"
            )
        if routes.dtype.kind not in "iu" or routes.min() < -1 or routes.max() > experts:
            raise ValueError(f"routes must be classes in [-1, {experts}] (the skip class is {experts})")
        return routes.astype(np.int32)
    return _vllm_routes(record, layers, experts, read)


def _vllm_routes(record: dict[str, Any], layers: int, experts: int, read: int) -> np.ndarray:
    """vLLM's ``routed_experts`` (tokens read, layers, top_k) expert indices and the ``routed_skip``
    (tokens read, layers) mask -> zaya classes: the expert, E where the mask is set, -1 kept."""
    routed = np.asarray(record["routed_experts"])
    if routed.ndim != 3 or routed.shape[:2] != (read, layers):
        raise ValueError(
            f"routed_experts have shape {routed.shape}, expected {(read, layers, 1)} (tokens read x layers x top_k)"
        )
    if routed.shape[2] != 1:
        raise ValueError(
            f"routed_experts hold top_k={routed.shape[2]} experts per token; ZAYA routes each token to one "
            "class (top_k=1), so only top_k=1 is supported"
        )
    if routed.dtype.kind not in "iu" or routed.min() < -1 or routed.max() >= experts:
        raise ValueError(f"routed_experts must be expert indices in [0, {experts}) (-1: not recorded)")
    if record.get("routed_skip") is None:  # every ZAYA model has the skip class (E + 1 router classes)
        raise ValueError(
            f"routed_experts without routed_skip: this model's router has a skip class besides its {experts} "
            "experts, and vLLM rewrites a skip choice to expert 0 (with weight 0), so these routes cannot "
            "tell a skipped token from one routed to expert 0 and replaying them would train a path the "
            "sampler never took. Supply routed_skip ([tokens read][layers] booleans, true where the router "
            "chose the skip class), or drop routed_experts to let the trainer's router choose"
        )
    skip = np.asarray(record["routed_skip"])
    if skip.shape != (read, layers) or skip.dtype.kind not in "biu" or not np.isin(skip, (0, 1)).all():
        raise ValueError(
            f"routed_skip must be {(read, layers)} booleans (tokens read x layers), got shape {skip.shape}"
        )
    routes, skip = routed[..., 0].astype(np.int32), skip.astype(bool)
    if (skip & (routes > 0)).any():
        t, layer = (int(i[0]) for i in np.nonzero(skip & (routes > 0)))
        raise ValueError(
            f"routed_skip marks token {t} layer {layer} as skipped but routed_experts holds expert "
            f"{routes[t, layer]} there (vLLM writes 0 for a skip): the mask does not line up with the routes"
        )
    return np.where(skip, experts, routes)
