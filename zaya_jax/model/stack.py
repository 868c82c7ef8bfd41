"""The decoder's blocks (spec §2.2) and the stack that scans them over depth: one block's
parameters are stacked along a leading ``layers`` axis, its per-layer inputs (EDA scale, RoPE
frequencies, sliding window, decode cache) scanned with it, the inputs every layer shares
(positions, masks) broadcast. Pattern of big_vision's ``models/vit.py`` encoder."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import ModelConfig
from zaya_jax.model.balancing import probability_moments, router_entropy_sum
from zaya_jax.model.cca import KV_CACHE_KEYS, CCAAttention, write_rows
from zaya_jax.model.experts import Experts
from zaya_jax.model.mesh_hooks import SINGLE_DEVICE, ModelHooks
from zaya_jax.model.norms import ResidualScaling, RMSNorm
from zaya_jax.model.rope import rope_frequencies
from zaya_jax.model.router import BALANCING, Router
from zaya_jax.ops.attention import AttentionMask, self_attention_mask
from zaya_jax.ops.residual_norm import residual_rms_norm

LAYER_CACHE_KEYS = ("conv", "vdel")  # scanned with the blocks, one row per layer
ROW_CACHE_KEYS = ("mask", "index", "window_slots")  # per row, not per layer: (batch, ...)


def cache_rows(cfg: ModelConfig, windowed: bool) -> np.ndarray:
    """(layers,) each layer's row in its stack of the decode cache: the layer's index, or with
    window caches its index among the full layers or among the sliding ones."""
    sliding = np.asarray([t == "hybrid_sliding" for t in cfg.resolved_layer_types])
    if not windowed:
        return np.arange(len(sliding), dtype=np.int32)
    return np.where(sliding, np.cumsum(sliding) - 1, np.cumsum(~sliding) - 1).astype(np.int32)


REMAT_POLICIES = {
    # Recompute the whole block: only each layer's input carry is kept for the backward pass.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep the outputs of weight matmuls (dots without batch dimensions), recompute the rest
    # (norms, activations, convolutions, attention scores, and o_proj's output: zaya_jax.model.cca).
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def positions_in_document(segment_ids: jax.Array) -> jax.Array:
    """(batch, seq) index of each token within its document (segments are contiguous runs)."""
    seq = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(seq), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class Block(nn.Module):
    """One decoder block; ``carry`` = (h float32 (batch, seq, embed), r (batch, seq, R), the stacked
    decode cache's keys and values (:data:`KV_CACHE_KEYS`) or None).

    ``layer`` holds this layer's scanned inputs (EDA scale, RoPE frequencies, sliding window, and
    with router replay the (batch, seq) classes to select, ``routes``),
    ``ctx`` the inputs shared by every layer (positions, masks). Returns the new carry and this
    layer's routing statistics.
    """

    cfg: ModelConfig
    hooks: ModelHooks = SINGLE_DEVICE

    @nn.compact
    def __call__(self, carry, layer: dict[str, jax.Array], ctx: dict[str, Any]):
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        h, r, kv = carry
        token_mask = ctx["token_mask"]
        cache = None
        if kv is not None:
            cache = {**layer["cache"], **kv, "layer": layer["layer"]}
            if "window_targets" in ctx:
                cache["window_targets"] = ctx["window_targets"]

        a = RMSNorm(cfg.rms_norm_eps, "embed", dtype, pdtype, name="input_norm")(h.astype(dtype))
        o, cache = CCAAttention(cfg, self.hooks, name="attn")(
            a,
            layer["inv_freq"],
            layer["window"],
            rope_scale=layer.get("rope_scale", 1.0),
            positions=ctx["positions"],
            mask=ctx["mask"],
            window_mask=ctx.get("window_mask"),
            segment_ids=ctx["segment_ids"],
            token_mask=token_mask,
            cache=cache,
            index=ctx.get("cache_index"),
        )
        if cache is not None:
            kv = {name: cache.pop(name) for name in KV_CACHE_KEYS if name in kv}
        merge = ResidualScaling(dtype, pdtype, name="post_attn_scale")
        norm = RMSNorm(cfg.rms_norm_eps, "embed", dtype, pdtype, name="post_attn_norm")
        plan = self.hooks.plan(cfg)
        if plan.norm == "kernel":  # one fused custom call (zaya_jax.ops), same parameters
            fused = self.hooks.residual_norm or functools.partial(residual_rms_norm, impl="custom")
            h, m = fused(
                o.astype(dtype),
                h,
                *merge(o, h, weights_only=True),
                norm(h, weight_only=True),
                eps=cfg.rms_norm_eps,
            )
        else:
            h = merge(o, h)
            m = norm(h.astype(dtype))
        routing = Router(cfg, name="router")(m, r, layer["eda_scale"], layer.get("routes"))
        # Recorded only when applied with mutable=["intermediates"] (notebooks, diagnostics).
        self.sow("intermediates", "router_state", routing.state)
        self.sow("intermediates", "router_probs", routing.probs)
        self.sow("intermediates", "router_choice", routing.choice)
        is_skip = routing.choice == cfg.num_experts
        weight = jnp.where(is_skip, 0, routing.weight)
        f, dropped = Experts(cfg, self.hooks.moe_dispatch, plan.moe_gemm == "kernel", name="experts")(
            m, routing.choice, weight
        )
        if cfg.mod_skip_output == "scaled_input":  # legacy "identity expert": p_skip * m
            f = f + jnp.where(is_skip, routing.weight, 0)[..., None].astype(dtype) * m
        h = ResidualScaling(dtype, pdtype, name="post_moe_scale")(f, h)

        valid = (
            jnp.ones(routing.choice.shape, jnp.float32)
            if token_mask is None
            else token_mask.astype(jnp.float32)
        )
        prob_dev_sum, prob_dev_sq_sum = probability_moments(routing.probs, valid)
        stats = {
            "load": jnp.einsum("bt,btc->c", valid, jax.nn.one_hot(routing.choice, cfg.num_experts + 1)),
            "dropped": jnp.sum(dropped * valid),
            "prob_dev_sum": prob_dev_sum,
            "prob_dev_sq_sum": prob_dev_sq_sum,
            "entropy_sum": router_entropy_sum(routing.probs, valid),
        }
        captured = layer.get("routes", layer.get("observed_routes"))
        if captured is not None:  # how often the router's own choice differs from the captured one
            known = valid * (captured >= 0)
            stats["routes_captured"] = jnp.sum(known)
            stats["route_flips"] = jnp.sum(known * (captured != routing.natural))
        return (h, routing.state, kv), (stats, cache)


def scanned_blocks(cfg: ModelConfig) -> type[nn.Module]:
    """The module class of the whole stack: :class:`Block` (rematerialised per ``cfg.remat``)
    scanned ``cfg.num_layers`` times. Instantiate it as ``(cfg, hooks, name="layers")`` and call
    it with ``((h, r, kv), layer_inputs, ctx)`` (``kv`` the decode cache's stacked keys and values,
    or None); it returns the final carry and the stacked per-layer (stats, conv/vdel cache). Each block folds its own slice of ``params["layers"]["lora"]``, if any, as it
    reads each weight (:mod:`zaya_jax.model.lowrank`)."""
    block = Block
    if cfg.remat != "none":
        # Keep only what the policy saves; the rest of the block is recomputed in the backward pass.
        block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
    return nn.scan(
        block,
        variable_axes={"params": 0, BALANCING: 0, "intermediates": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast),
        length=cfg.num_layers,
        unroll=min(cfg.scan_unroll, cfg.num_layers),
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


def layer_inputs(cfg: ModelConfig, eda_scale: jax.Array) -> dict[str, jax.Array]:
    """The inputs scanned with the blocks, one row per layer."""
    rope = {
        "hybrid": rope_frequencies(cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling, cfg.rope_truncate),
        "hybrid_sliding": rope_frequencies(
            cfg.rope_theta_sliding, cfg.rotary_dim, cfg.rope_scaling_sliding, cfg.rope_truncate
        ),
    }
    types = cfg.resolved_layer_types
    inputs = {
        # Block 0 has no EDA: a zero scale row adds an exact zero to its router state.
        "eda_scale": jnp.concatenate([jnp.zeros((1, cfg.router_hidden_size), eda_scale.dtype), eda_scale]),
        "inv_freq": jnp.asarray(np.stack([rope[t][0] for t in types])),
        "window": jnp.asarray([cfg.sliding_window if t == "hybrid_sliding" else 0 for t in types], jnp.int32),
    }
    if any(rope[t][1] != 1.0 for t in types):  # yarn's cos/sin scale, per layer
        inputs["rope_scale"] = jnp.asarray([rope[t][1] for t in types], jnp.float32)
    return inputs


def shared_inputs(
    shape: tuple[int, int],
    token_mask: jax.Array | None,
    segment_ids: jax.Array | None,
    positions: jax.Array | None,
    cache: dict[str, jax.Array] | None,
) -> dict[str, Any]:
    """The inputs every layer shares: RoPE positions, the attention mask, segment ids, the token
    mask; with a decode cache also the slot index the chunk is written at and the cache's updated
    key mask (``key_mask``). A cache whose ``index`` is (batch,) is a slot cache: row b's chunk is
    written at slots [index[b], index[b] + seq), its real tokens first (right padding). Positions default to arange, the index within the document when
    ``segment_ids`` are given, or the cache slots when decoding."""
    batch, seq = shape
    if cache is None:
        if positions is None:
            positions = (
                positions_in_document(segment_ids)
                if segment_ids is not None
                else jnp.broadcast_to(jnp.arange(seq), (batch, seq))
            )
        mask = self_attention_mask(seq, segment_ids, token_mask)
        return {"positions": positions, "mask": mask, "segment_ids": segment_ids, "token_mask": token_mask}
    if segment_ids is not None:
        raise ValueError("segment_ids (packed documents) cannot be combined with a decode cache")
    index = cache["index"]
    new_mask = jnp.ones((batch, seq), jnp.int32) if token_mask is None else token_mask.astype(jnp.int32)
    window = {}
    if index.ndim == 1:  # a slot cache: each row written at its own slot (zaya_jax.engine)
        query_slots = index[:, None] + jnp.arange(seq)
        key_mask = write_rows(cache["mask"], new_mask, index)
        if "window_slots" in cache:
            window = window_inputs(cache["window_slots"], query_slots.astype(jnp.int32), new_mask)
    else:
        query_slots = index + jnp.arange(seq)
        key_mask = jax.lax.dynamic_update_slice(cache["mask"], new_mask, (0, index))
    if positions is None:
        positions = jnp.broadcast_to(query_slots, (batch, seq))
    mask = AttentionMask(
        q_slots=query_slots.astype(jnp.int32),
        k_slots=jnp.arange(key_mask.shape[1], dtype=jnp.int32),
        k_valid=key_mask.astype(bool),
    )
    return {
        "positions": positions,
        "mask": mask,
        "segment_ids": None,
        "token_mask": token_mask,
        "cache_index": index,
        "key_mask": key_mask,
        **window,
    }


def window_inputs(slots: jax.Array, query_slots: jax.Array, real: jax.Array) -> dict[str, Any]:
    """What the sliding layers of a slot cache with window caches share for a chunk: each layer's
    window cache is a ring of R positions per row, position p at ring slot p % R, and ``slots``
    (batch, R) says which position each ring slot holds (-1: none yet).

    A sliding layer attends to its ring as it was before the chunk followed by the chunk's own
    keys, then writes the chunk's last R real tokens into the ring: so R = the window covers what
    any query of any chunk width can see. Returns ``window_mask`` (over the R ring slots then the
    chunk, the window added by the layer), ``window_targets`` (batch, seq) the ring slot each new
    token is written to (R: not written) and ``window_slots``, the ring's positions after the chunk."""
    ring = slots.shape[1]
    keep = real > 0
    last = jnp.sum(real, axis=1) + query_slots[:, 0]  # one past each row's last real position
    keep = keep & (query_slots >= last[:, None] - ring)
    targets = jnp.where(keep, query_slots % ring, ring)
    rows = jnp.arange(slots.shape[0])[:, None]
    mask = AttentionMask(
        q_slots=query_slots,
        k_slots=jnp.concatenate([slots, query_slots], axis=1),
        k_valid=jnp.concatenate([slots >= 0, real > 0], axis=1),
    )
    return {
        "window_mask": mask,
        "window_targets": targets,
        "window_slots": slots.at[rows, targets].set(query_slots, mode="drop"),
    }
