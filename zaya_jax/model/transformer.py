"""The ZAYA1 decoder: embedding with input scale/bias, L blocks scanned over depth
(:mod:`zaya_jax.model.stack`), final norm, tied LM head (spec §2.1-§2.2). Block: CCA attention and a
top-1 MoE, each merged into the float32 residual stream by a learned residual scaling; the router
state r is carried across blocks (EDA).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from zaya_jax.model.axes import ACTIVATION_AXES
from zaya_jax.model.layers import Dense, param_with_axes
from zaya_jax.model.lowrank import ADAPTER, fold
from zaya_jax.model.mesh_hooks import SINGLE_DEVICE, ContextParallelism, ModelHooks
from zaya_jax.model.norms import RMSNorm
from zaya_jax.model.stack import (
    KV_CACHE_KEYS,
    LAYER_CACHE_KEYS,
    cache_rows,
    layer_inputs,
    scanned_blocks,
    shared_inputs,
)


def _embedding_init(pad_token_id: int, std: float):
    """N(0, std) with the padding row zeroed, as HF initialises ``embed_tokens``."""

    def init(key, shape, dtype=jnp.float32):
        table = jax.random.normal(key, shape, dtype) * std
        return table.at[pad_token_id].set(0)

    return init


def _reordered(
    layout: ContextParallelism, tokens, token_mask, segment_ids, positions, routes
) -> tuple[jax.Array | None, ...]:
    """The token inputs in the order the devices of a context layout hold the sequence
    (positions computed first: they follow the documents in sequence order)."""
    batch, seq = tokens.shape
    positions = shared_inputs((batch, seq), token_mask, segment_ids, positions, None)["positions"]
    inputs = (tokens, token_mask, segment_ids, positions, routes)
    return tuple(None if x is None else layout.reorder(x) for x in inputs)


class Zaya(nn.Module):
    """ZAYA1 causal LM.

    tokens: (batch, seq) int. Optional: ``token_mask`` (batch, seq) 1 = real token, 0 = padding
    (HF's 2-D ``attention_mask``); ``segment_ids`` (batch, seq) ids of packed documents;
    ``positions`` (batch, seq) RoPE positions (default: arange, or the index within the document
    when ``segment_ids`` is given).

    Returns ``(logits, aux)``: logits (batch, seq, vocab) in the compute dtype (with
    ``return_hidden=True`` instead the final-norm hidden states (batch, seq, embed) the LM head
    reads, see :func:`lm_head_weights`); aux holds per-layer
    routing statistics: ``load`` (layers, E+1) tokens per class, ``dropped`` (layers,) tokens the
    capacity path dropped, ``prob_dev_sum`` and ``prob_dev_sq_sum`` (layers, E+1) sums over real
    tokens of the router probabilities' deviations from 1/(E+1) and of their squares
    (:func:`~zaya_jax.model.balancing.probability_moments`; their spread scales the balancing controller),
    ``entropy_sum`` (layers,) the router distributions' entropies summed over real tokens.

    Low-rank adapters in ``params`` (``params["layers"]["lora"]``, ``params["lora"]``) are folded
    into their weights on the fly (:mod:`zaya_jax.model.lowrank`).

    Decoding: pass ``cache`` (from :func:`init_cache`) and ``tokens`` are the next chunk, written at
    cache slots [cache["index"], cache["index"] + seq); ``token_mask`` marks their real tokens (left
    padding) and ``positions`` default to the slot indices. ``aux["cache"]`` is then the updated cache.
    ``segment_ids`` cannot be combined with a cache.

    Router replay: ``routes`` (batch, seq, layers) int32 forces each layer's selection to the class
    given for each token (an expert index, or E for the skip class; -1 routes that token normally),
    as captured by a sampler (:func:`zaya_jax.generate.generate` with ``return_routes=True``). The
    router's probabilities stay in the graph, so the chosen class's weight and the router's gradient
    are those of normal training. With ``replay_routes=False`` the routes are only compared, not
    forced. Either way aux adds per layer ``routes_captured`` (tokens with a route given) and
    ``route_flips`` (those whose router, unforced, would choose another class).

    Applied with ``mutable=["intermediates"]``, each layer also records its router's post-EDA state
    (``router_state``, (layers, batch, seq, R)), probabilities (``router_probs``) and chosen class
    (``router_choice``) under ``intermediates["layers"]``, each wrapped in a 1-tuple by ``sow``.

    ``hooks`` (:class:`~zaya_jax.model.mesh_hooks.ModelHooks`) optionally replace local code paths for
    a mesh: the MoE paths (expert parallelism), the attention kernel (tree attention over a
    sequence-split cache), CCA's temporal parts and attention over a sequence split across devices
    (ring attention), and the fused merge+norm op used when ``cfg.kernels == "custom"``;
    parameters and results are the same.
    """

    cfg: ModelConfig
    hooks: ModelHooks = SINGLE_DEVICE

    def _input_params(self, pdtype: jnp.dtype) -> tuple[jax.Array, ...]:
        """The embedding, its input scale and bias, and the router's depth-averaging scales."""
        cfg = self.cfg
        embed_shape = (cfg.hidden_size,)
        embedding = param_with_axes(
            self,
            "embedding",
            _embedding_init(cfg.pad_token_id, cfg.initializer_range),
            (cfg.vocab_size, cfg.hidden_size),
            ("vocab", "embed"),
            pdtype,
        )
        input_scale = param_with_axes(
            self, "input_scale", nn.initializers.ones, embed_shape, ("embed",), pdtype
        )
        input_bias = param_with_axes(
            self, "input_bias", nn.initializers.zeros, embed_shape, ("embed",), pdtype
        )
        eda_shape = (cfg.num_layers - 1, cfg.router_hidden_size)
        eda_scale = param_with_axes(
            self, "router_states_scale", nn.initializers.ones, eda_shape, ("layers", "router"), pdtype
        )
        return embedding, input_scale, input_bias, eda_scale

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        token_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        cache: dict[str, jax.Array] | None = None,
        routes: jax.Array | None = None,
        replay_routes: bool = True,
        return_hidden: bool = False,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        batch, seq = tokens.shape
        embedding, input_scale, input_bias, eda_scale = self._input_params(pdtype)

        per_layer = layer_inputs(cfg, eda_scale)
        layout = self.hooks.context if cache is None else None  # a sequence split over devices
        if layout is not None:
            tokens, token_mask, segment_ids, positions, routes = _reordered(
                layout, tokens, token_mask, segment_ids, positions, routes
            )
        ctx = shared_inputs((batch, seq), token_mask, segment_ids, positions, cache)
        key_mask = ctx.pop("key_mask", None)
        window_slots = ctx.pop("window_slots", None)
        kv = None
        if cache is not None:
            per_layer["cache"] = {k: cache[k] for k in LAYER_CACHE_KEYS}
            per_layer["layer"] = jnp.asarray(cache_rows(cfg, windowed="window_keys" in cache))
            kv = {k: cache[k] for k in KV_CACHE_KEYS if k in cache}
        if routes is not None:  # scanned with the blocks: (layers, batch, seq)
            per_layer["routes" if replay_routes else "observed_routes"] = jnp.moveaxis(
                jnp.asarray(routes, jnp.int32), -1, 0
            )

        e = jnp.take(embedding, tokens, axis=0).astype(dtype)
        h = ((e + input_bias.astype(dtype)) * input_scale.astype(dtype)).astype(jnp.float32)
        h = nn.with_logical_constraint(h, ACTIVATION_AXES)
        r = jnp.zeros((batch, seq, cfg.router_hidden_size), dtype)
        (h, _, kv), (stats, layer_cache) = scanned_blocks(cfg)(cfg, self.hooks, name="layers")(
            (h, r, kv), per_layer, ctx
        )
        if cache is not None:
            advance = seq
            if cache["index"].ndim == 1 and token_mask is not None:  # a slot cache: real tokens per row
                advance = jnp.sum(token_mask, axis=1, dtype=jnp.int32)
            new_cache = {**layer_cache, **kv, "mask": key_mask, "index": cache["index"] + advance}
            if window_slots is not None:
                new_cache["window_slots"] = window_slots
            stats = {**stats, "cache": new_cache}

        y = RMSNorm(cfg.rms_norm_eps, "embed", dtype, pdtype, name="final_norm")(h.astype(dtype))
        y = nn.with_logical_constraint(y if layout is None else layout.restore(y), ACTIVATION_AXES)
        if return_hidden:  # the loss applies the head chunk by chunk (zaya_jax.ops.cross_entropy)
            return y, stats
        if cfg.tie_word_embeddings:
            logits = jnp.dot(y, embedding.astype(dtype).T)
            if cfg.lm_head_bias:
                bias = param_with_axes(
                    self, "lm_head_bias", nn.initializers.zeros, (cfg.vocab_size,), ("vocab",), pdtype
                )
                logits = logits + bias.astype(dtype)
            return logits, stats
        head = Dense(
            cfg.vocab_size,
            ("embed", "vocab"),
            cfg.lm_head_bias,
            cfg.initializer_range,
            dtype,
            pdtype,
            name="lm_head",
        )
        return head(y), stats


def lm_head_weights(cfg: ModelConfig, params: dict[str, Any]) -> tuple[jax.Array, jax.Array | None, int]:
    """The LM head as stored in ``params``: (weight, bias or None, vocab axis of the weight).
    Tied: the (vocab, embed) embedding table (axis 0); untied: the (embed, vocab) ``lm_head`` kernel."""
    if cfg.tie_word_embeddings:
        table = params["embedding"]
        if ADAPTER in params:  # the adapted table (zaya_jax.model.lowrank)
            table = fold({"embedding": table, ADAPTER: params[ADAPTER]})["embedding"]
        return table, params.get("lm_head_bias"), 0
    head = params["lm_head"]
    return head["kernel"], head.get("bias"), 1


def init_cache(
    cfg: ModelConfig,
    batch: int,
    length: int,
    dtype: jax.typing.DTypeLike | None = None,
    per_row: bool = False,
    window_caches: bool = True,
) -> dict[str, jax.Array]:
    """An empty decode cache for ``length`` token slots (spec §3), stacked over layers.

    ``keys``/``values`` (layers, batch, nk, length, d): post-norm, post-temp, post-RoPE keys and the
    shifted values, in the attention's (heads, positions) layout; ``conv`` (layers, batch, P, C): the last P raw [q0 || k0] columns; ``vdel``
    (layers, batch, nk*d/2): the most recent delayed-value projection; ``mask`` (batch, length) 1 for
    slots holding real tokens; ``index`` the next free slot. Every layer keeps all ``length`` slots;
    sliding-window layers mask by slot distance.

    ``per_row``: a slot cache (:mod:`zaya_jax.engine`), ``index`` (batch,) the next free slot of
    each row: each row is its own sequence, written at its own offset, real tokens first in a chunk
    (``token_mask`` marks them; the row's index advances by their count). Its sliding layers (when
    their window is shorter than ``length`` and ``window_caches``) keep window caches instead:
    ``keys``/``values`` then stack only the full layers, ``window_keys``/``window_values``
    (sliding layers, batch, nk, window, d) the sliding layers' rings, and ``window_slots``
    (batch, window) the position each ring slot holds (-1: none), the same for every sliding
    layer (:func:`~zaya_jax.model.stack.window_inputs`).
    """
    dtype = jnp.dtype(dtype or cfg.dtype)
    layers, nk, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    context = cfg.conv_context
    window = cfg.sliding_window if per_row and window_caches and cfg.has_sliding_layers else None
    sliding = (
        sum(t == "hybrid_sliding" for t in cfg.resolved_layer_types) if window and window < length else 0
    )
    full = layers - sliding
    cache = {
        "keys": jnp.zeros((full, batch, nk, length, d), dtype),
        "values": jnp.zeros((full, batch, nk, length, d), dtype),
        "conv": jnp.zeros((layers, batch, context, cfg.conv_channels), dtype),
        "vdel": jnp.zeros((layers, batch, cfg.kv_width // 2), dtype),
        "mask": jnp.zeros((batch, length), jnp.int32),
        "index": jnp.zeros((batch,) if per_row else (), jnp.int32),
    }
    if sliding:
        cache["window_keys"] = jnp.zeros((sliding, batch, nk, window, d), dtype)
        cache["window_values"] = jnp.zeros((sliding, batch, nk, window, d), dtype)
        cache["window_slots"] = jnp.full((batch, window), -1, jnp.int32)
    return cache


# Tracing the model's init is seconds of Python for a config; a config's variables are the same on
# every call, so their shapes and the jitted init are kept per (frozen, hashable) config. Neither
# how the model computes (``ModelConfig.architecture``) nor its MoE path changes which variables it
# has, so the shapes are kept per config with those at their defaults: a run asks for them under its
# layout's choices and under the config's own (a MINI run: 3 traces of 0.15-0.45 s each -> 1).
_MOE_PATH = {name: ModelConfig.__dataclass_fields__[name].default for name in ("moe_impl", "capacity_factor")}


def boxed_abstract_variables(cfg: ModelConfig) -> dict[str, Any]:
    """Shapes and dtypes of the model's variables, each boxed with its logical axis names
    (``nn.LogicallyPartitioned``); ``jax.eval_shape``, nothing allocated. Shared: do not mutate."""
    return _boxed_abstract_variables(dataclasses.replace(cfg.architecture(), **_MOE_PATH))


@functools.lru_cache(maxsize=64)
def _boxed_abstract_variables(cfg: ModelConfig) -> dict[str, Any]:
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(lambda t: Zaya(cfg).init(jax.random.key(0), t), tokens)


def abstract_variables(cfg: ModelConfig) -> dict[str, Any]:
    """Unboxed shapes and dtypes of the model's variables (``jax.eval_shape``: nothing is allocated)."""
    return nn.unbox(boxed_abstract_variables(cfg))


@functools.lru_cache(maxsize=64)
def _jitted_init(cfg: ModelConfig) -> Callable[[jax.Array], dict[str, Any]]:
    return jax.jit(lambda k: nn.unbox(Zaya(cfg).init(k, jnp.zeros((1, 1), jnp.int32))))


def init_variables(cfg: ModelConfig, seed: int | jax.Array = 0) -> dict[str, Any]:
    """Freshly initialised, unboxed ``{"params", "balancing"}`` (HF init: N(0, initializer_range) weights,
    unit norms and scales, zero biases and ``temp``, balancing biases 0 / -1 for the skip class)."""
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    return _jitted_init(cfg)(key)
