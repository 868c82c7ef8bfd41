"""Compressed Convolutional Attention (CCA), spec §2.3.

Queries and keys live in a compressed latent (nq*d and nk*d wide), are mixed over time by a
two-stage causal convolution (depthwise, then grouped per head) padded once, keep "mean" residual
paths, are L2-normalised (keys scaled by a raw per-KV-head ``temp``) and get partial NeoX RoPE.
Values are half current-token, half previous-token projections. Attention is causal GQA, optionally
sliding-window; only ``o_proj`` returns to the residual width.

Packed sequences: with ``segment_ids`` every temporal path (attention, both convolutions, the
delayed value) restarts at a document boundary exactly as it does at t = 0.

Decoding (spec §3): with a layer ``cache`` the layer reads and returns the post-RoPE keys, the values,
the last P raw q/k columns (the conv state) and the most recent delayed-value projection, so a chunk
of T new tokens costs O(T) projections and convolutions plus attention over the cache.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from zaya_jax.model.layers import Dense, param_with_axes
from zaya_jax.model.mesh_hooks import SINGLE_DEVICE, ModelHooks
from zaya_jax.model.rope import apply_rope, rope_tables
from zaya_jax.ops import cca_cpu
from zaya_jax.ops.attention import AttentionMask, attention

# The decode cache's stacks carried through the blocks and written in place: every full layer's
# keys and values, and in a slot cache with window caches (zaya_jax.model.init_cache) every sliding
# layer's ring.
KV_CACHE_KEYS = ("keys", "values", "window_keys", "window_values")


def shift_right(x: jax.Array, shift: int) -> jax.Array:
    """x[:, t - shift] along axis 1, zero for t < shift. x: (batch, seq, ...)."""
    if shift == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (shift, 0)
    return jnp.pad(x, pad)[:, : x.shape[1]]


def same_document(segment_ids: jax.Array | None, seq_len: int, shift: int) -> jax.Array:
    """(batch or 1, seq) bool: position t - shift exists and belongs to the same document as t."""
    exists = (jnp.arange(seq_len) >= shift)[None, :]
    if segment_ids is None or shift == 0:
        return exists
    return exists & (shift_right(segment_ids, shift) == segment_ids)


def two_stage_conv(
    z: jax.Array,
    depthwise_kernel: jax.Array,
    depthwise_bias: jax.Array,
    grouped_kernel: jax.Array,
    grouped_bias: jax.Array,
    segment_ids: jax.Array | None,
) -> jax.Array:
    """The CCA q/k convolution with the P = (k0-1)+(k1-1) left context padded *once* (spec §2.3 step 3).

    z: (batch, seq, C) raw [q0 || k0]; depthwise_kernel: (k0, C); grouped_kernel: (k1, heads, d, d)
    as [tap, group, in, out]; biases: (C,). Tap j reads time t - (K-1) + j (cross-correlation, no flip).
    Stage 1 reads zeros before the document start; stage 2 reads the stage-1 output of those
    negative times, which is the stage-1 bias (not zero). Returns (batch, seq, C).
    """
    batch, seq, channels = z.shape
    k0, k1 = depthwise_kernel.shape[0], grouped_kernel.shape[0]
    heads, head_dim = grouped_kernel.shape[1], grouped_kernel.shape[2]

    stage1 = depthwise_bias
    for tap in range(k0):
        shift = k0 - 1 - tap
        keep = same_document(segment_ids, seq, shift)[..., None]
        stage1 = stage1 + depthwise_kernel[tap] * jnp.where(keep, shift_right(z, shift), 0)

    stage2 = grouped_bias
    for tap in range(k1):
        shift = k1 - 1 - tap
        keep = same_document(segment_ids, seq, shift)[..., None]
        past = jnp.where(keep, shift_right(stage1, shift), depthwise_bias)
        past = past.reshape(batch, seq, heads, head_dim)
        stage2 = stage2 + jnp.einsum("btgi,gio->btgo", past, grouped_kernel[tap]).reshape(
            batch, seq, channels
        )
    return stage2


def two_stage_conv_valid(
    z_full: jax.Array,
    depthwise_kernel: jax.Array,
    depthwise_bias: jax.Array,
    grouped_kernel: jax.Array,
    grouped_bias: jax.Array,
) -> jax.Array:
    """The CCA q/k convolution over z_full = [P context columns || T new columns], both stages VALID.

    Used when decoding: the context is the cached conv state (zeros before the first token, which
    makes this equal to :func:`two_stage_conv` without segments). Returns (batch, T, C).
    """
    batch, _, channels = z_full.shape
    k0, k1 = depthwise_kernel.shape[0], grouped_kernel.shape[0]
    heads, head_dim = grouped_kernel.shape[1], grouped_kernel.shape[2]
    seq = z_full.shape[1] - (k0 - 1) - (k1 - 1)
    n1 = seq + k1 - 1  # stage-1 outputs stage 2 reads
    stage1 = depthwise_bias
    for tap in range(k0):
        stage1 = stage1 + depthwise_kernel[tap] * z_full[:, tap : tap + n1]
    stage2 = grouped_bias
    for tap in range(k1):
        past = stage1[:, tap : tap + seq].reshape(batch, seq, heads, head_dim)
        stage2 = stage2 + jnp.einsum("btgi,gio->btgo", past, grouped_kernel[tap]).reshape(
            batch, seq, channels
        )
    return stage2


def l2_normalize(x: jax.Array, scale: float) -> jax.Array:
    """x * scale / max(||x||_2, eps) over the last axis, eps = machine epsilon of x's dtype (HF ``ZayaQKNorm``).

    Written as sqrt(max(sum x^2, eps^2)) so that an all-zero head (a padding position) gets a zero
    gradient instead of the NaN that differentiating ``norm`` at 0 gives.
    """
    eps = jnp.finfo(x.dtype).eps
    sum_sq = jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    return x * (jnp.asarray(scale, x.dtype) / jnp.sqrt(jnp.maximum(sum_sq, jnp.asarray(eps * eps, x.dtype))))


def _delayed_plain(vd, vd_at_start, segment_ids):
    """Step 4 on a whole sequence: the delayed value half is the previous token's projection,
    ``W_vdel . 0`` at a document start."""
    return jnp.where(same_document(segment_ids, vd.shape[1], 1)[..., None], shift_right(vd, 1), vd_at_start)


def _temporal_plain(z, vd, vd_at_start, conv_weights, segment_ids):
    """Steps 3-4 on a whole sequence: the two-stage convolution, and the value shift."""
    return two_stage_conv(z, *conv_weights, segment_ids), _delayed_plain(vd, vd_at_start, segment_ids)


def _fused_plain(z, conv_weights, temp, tables, segment_ids, segments, queries_keys, cfg: ModelConfig):
    """Steps 2-6 of the plain mode from z = [q0 || k0] to (q, k) as the CPU custom call
    (:mod:`zaya_jax.ops.cca_cpu`; the kernel plan's ``cca_qk``, taken with the CPU attention call in
    float32), the JAX steps (the convolution, then ``queries_keys``) on other devices."""

    def on_cpu(z, segments):
        nq, nk = cfg.num_heads, cfg.num_kv_heads
        return cca_cpu.cpu_cca_qk(z, *conv_weights, temp, *tables, segments, nq=nq, nk=nk)

    def elsewhere(z, segments):
        return queries_keys(two_stage_conv(z, *conv_weights, segment_ids))

    return jax.lax.platform_dependent(z, segments, cpu=on_cpu, default=elsewhere)


def _temporal_decode(z, vd, vd_at_start, conv_weights, cache, index, context: int, token_mask=None):
    """Steps 3-4 for T new tokens after the cached ones (spec §3): the convolution reads the cached
    last P raw columns, the value shift the cached last delayed projection. Returns (conv, vd, the
    conv-state and delayed-value parts of the new cache).

    A slot cache (``index`` (batch,)) has its real tokens (``token_mask``) first in each row's
    chunk: its conv state and delayed value are those after its last real token (unchanged for none)."""
    dtype = z.dtype
    real = None
    if index.ndim == 1:
        real = jnp.full(z.shape[:1], z.shape[1], jnp.int32) if token_mask is None else token_mask.sum(1)
    z_full = jnp.concatenate([cache["conv"].astype(dtype), z], axis=1)
    conv = two_stage_conv_valid(z_full, *conv_weights)
    at_start = (index == 0)[..., None] if index.ndim else index == 0
    previous = jnp.where(at_start, vd_at_start[:, 0], cache["vdel"].astype(dtype))
    if real is None:
        conv_state, last_vd = z_full[:, z_full.shape[1] - context :], vd[:, -1]
    else:  # the P columns ending at each row's last real token; its last delayed projection
        conv_state = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, context))(z_full, real)
        last = jnp.take_along_axis(vd, jnp.maximum(real - 1, 0)[:, None, None], axis=1)[:, 0]
        last_vd = jnp.where((real > 0)[:, None], last, cache["vdel"].astype(dtype))
    updates = {"conv": conv_state.astype(cache["conv"].dtype), "vdel": last_vd.astype(cache["vdel"].dtype)}
    return conv, jnp.concatenate([previous[:, None], vd[:, :-1]], axis=1), updates


def write_rows(buffer: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """``buffer`` (batch, S, ...) with each row's ``new`` (batch, T, ...) written at its own slots
    [index[b], index[b] + T); slots past S are dropped (never clamped onto earlier ones)."""
    rows = jnp.arange(buffer.shape[0])[:, None]
    slots = index[:, None] + jnp.arange(new.shape[1])[None, :]
    return buffer.at[rows, slots].set(new.astype(buffer.dtype), mode="drop")


def _write_cache(cache, k, v, index):
    """The new keys and values (batch, T, nk, d) written into layer ``cache["layer"]`` of the
    stacked (layers, batch, nk, S, d) cache at positions [index, index + T) (a slot cache: each row at
    its own ``index``, positions past S dropped). Returns (this layer's keys and values over all S
    positions as (batch, S, nk, d), the updated stacks).

    The stacks are carried through the layer loop and written in place, in the attention's
    (heads, positions) layout: sliced out of a scanned stack and transposed for the attention, a
    384-position cache cost 4 copies per layer and step (``bench/cache_layout.py``)."""
    keys, values, layer = cache["keys"], cache["values"], cache["layer"]
    batch, seq = k.shape[:2]
    if index.ndim == 1:
        rows, slots = jnp.arange(batch)[:, None], index[:, None] + jnp.arange(seq)[None, :]
        keys = keys.at[layer, rows, :, slots].set(k.astype(keys.dtype), mode="drop")
        values = values.at[layer, rows, :, slots].set(v.astype(values.dtype), mode="drop")
    else:
        start = (layer, 0, 0, index, 0)
        keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype).transpose(0, 2, 1, 3)[None], start)
        values = jax.lax.dynamic_update_slice(
            values, v.astype(values.dtype).transpose(0, 2, 1, 3)[None], start
        )
    here = lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=False).transpose(0, 2, 1, 3)  # noqa: E731
    return here(keys), here(values), {"keys": keys, "values": values}


def _write_window(cache, k, v, targets):
    """The new keys and values (batch, T, nk, d) of a sliding layer written into its ring, layer
    ``cache["layer"]`` of the stacked (sliding layers, batch, nk, R, d) window caches, at ring slots
    ``targets`` (batch, T) (R: not written). Returns (the ring as it was before the chunk followed
    by the chunk, as (batch, R + T, nk, d) keys and values, the updated stacks)."""
    keys, values, layer = cache["window_keys"], cache["window_values"], cache["layer"]
    rows = jnp.arange(k.shape[0])[:, None]
    here = lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=False).transpose(0, 2, 1, 3)  # noqa: E731
    seen_k = jnp.concatenate([here(keys), k.astype(keys.dtype)], axis=1)
    seen_v = jnp.concatenate([here(values), v.astype(values.dtype)], axis=1)
    keys = keys.at[layer, rows, :, targets].set(k.astype(keys.dtype), mode="drop")
    values = values.at[layer, rows, :, targets].set(v.astype(values.dtype), mode="drop")
    return seen_k, seen_v, {"window_keys": keys, "window_values": values}


def _normalized_rotated(q: jax.Array, k: jax.Array, temp: jax.Array, tables: tuple[jax.Array, jax.Array]):
    """Steps 5-6: q and k L2-normalised to sqrt(d), k scaled by the per-KV-head ``temp``, both
    rotated by the RoPE ``tables`` (cos, sin)."""
    scale = math.sqrt(q.shape[-1])
    q = l2_normalize(q, scale)
    k = l2_normalize(k, scale) * temp[None, None, :, None]
    cos, sin = tables
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _mean_residuals(q0: jax.Array, k0: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Step 2: the q/k "mean" residual paths: each q head averaged with its KV head, each KV head
    with its q group; (q_res (batch, seq, nq, d), k_res (batch, seq, nk, d))."""
    batch, seq, _ = q0.shape
    nq, nk, d, groups = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_kv_groups
    q_heads = q0.reshape(batch, seq, nq, d)
    k_heads = k0.reshape(batch, seq, nk, d)
    q_res = (q_heads + jnp.repeat(k_heads, groups, axis=2)) * jnp.asarray(0.5, q0.dtype)
    return q_res, jnp.mean(q_res.reshape(batch, seq, nk, groups, d), axis=3)


class CCAAttention(nn.Module):
    """One CCA attention layer (spec §2.3). a: (batch, seq, embed) normed input -> (output (batch,
    seq, embed), updated layer cache or None).

    ``mask`` says which keys each query sees (causal, documents, padding; this layer's sliding
    ``window`` is added here). ``cache`` (decoding) = {"keys", "values": every layer's, stacked
    (layers, batch, nk, S, d), "layer": this layer's index, "conv": (batch, P, C), "vdel": (batch,
    nk*d/2)} with the new tokens written at slots [index, index + seq); ``mask`` then spans the S
    cache slots. The updated cache returned holds the updated stacks, this layer's conv and vdel.

    Three modes share the spec's steps and differ only in the temporal parts (convolution, value
    shift) and the attention: *plain* (one device holds the sequence), *context* (the sequence is
    split over devices: ``hooks.context``) and *decode* (a ``cache``).
    """

    cfg: ModelConfig
    hooks: ModelHooks = SINGLE_DEVICE

    def _attend_local(self, q, k, v, mask, cache, index, new_cache, window, window_mask):
        """Attention where one device holds every key: the plain and decode modes (decoding first
        writes the new keys and values into the cache). Returns (output, updated cache or None).

        A slot cache with window caches (``"window_keys"``) holds a sliding layer's keys in a ring
        of its window's size: such a layer attends to the ring and the chunk, then writes the chunk
        into the ring (:func:`~zaya_jax.model.stack.window_inputs`); which of the two a layer is
        comes from its scanned ``window`` (a ``lax.cond``, one program for every layer)."""
        cfg = self.cfg
        local = functools.partial(attention, impl=self.hooks.plan(cfg).attention, block=cfg.attention_block)
        kernel = self.hooks.attention or local
        if cache is None:
            return kernel(q, k, v, mask), new_cache
        stacks = {name: cache[name] for name in KV_CACHE_KEYS if name in cache}

        def full(stacks):
            keys, values, written = _write_cache({**stacks, "layer": cache["layer"]}, k, v, index)
            return kernel(q, keys.astype(q.dtype), values.astype(q.dtype), mask), {**stacks, **written}

        def ring(stacks):
            keys, values, written = _write_window(
                {**stacks, "layer": cache["layer"]}, k, v, cache["window_targets"]
            )
            out = local(q, keys.astype(q.dtype), values.astype(q.dtype), window_mask.replace(window=window))
            return out, {**stacks, **written}

        if "window_keys" not in stacks:
            out, stacks = full(stacks)
        elif stacks["keys"].shape[0] == 0:  # every layer slides
            out, stacks = ring(stacks)
        else:
            out, stacks = jax.lax.cond(window > 0, ring, full, stacks)
        return out, {**new_cache, **stacks}

    def _temporal(
        self, mode, z, vd, vd_at_start, conv_weights, segment_ids, segments, cache, index, token_mask
    ):
        """Steps 3-4 in the JAX steps of ``mode``: (convolution of z, delayed values, the decode
        cache's conv state and delayed value or None)."""
        cfg = self.cfg
        if mode == "plain":
            return (*_temporal_plain(z, vd, vd_at_start, conv_weights, segment_ids), None)
        if mode == "context":
            return (
                *self.hooks.context.temporal(z, vd, vd_at_start, segments, *conv_weights, cfg.conv_context),
                None,
            )
        return _temporal_decode(z, vd, vd_at_start, conv_weights, cache, index, cfg.conv_context, token_mask)

    @nn.compact
    def __call__(
        self,
        a: jax.Array,
        inv_freq: jax.Array,
        window: jax.Array,
        *,
        rope_scale: jax.Array | float = 1.0,
        positions: jax.Array,
        mask: AttentionMask,
        window_mask: AttentionMask | None = None,
        segment_ids: jax.Array | None,
        token_mask: jax.Array | None,
        cache: dict[str, jax.Array] | None = None,
        index: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        batch, seq, _ = a.shape
        nq, nk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        std = cfg.initializer_range
        mode = "decode" if cache is not None else "context" if self.hooks.context is not None else "plain"

        def dense(name: str, features: int, axes: tuple[str, str], recomputed: bool = False) -> Dense:
            return Dense(features, axes, cfg.attention_bias, std, dtype, pdtype, recomputed, name=name)

        # Steps 0-1: padded positions become exact zeros, then the projections into the compressed latent.
        if token_mask is not None:
            a = a * token_mask[:, :, None].astype(a.dtype)
        q0 = dense("q_proj", cfg.q_width, ("embed", "heads"))(a)
        k0 = dense("k_proj", cfg.kv_width, ("embed", "kv"))(a)
        v_current = dense("v_current", cfg.kv_width // 2, ("embed", "kv"))(a)
        v_delayed_proj = dense("v_delayed", cfg.kv_width // 2, ("embed", "kv"))

        q_res, k_res = _mean_residuals(q0, k0, cfg)

        # Steps 3-4: the two-stage causal convolution of [q0 || k0] and the delayed value half.
        normal, zeros = nn.initializers.normal(std), nn.initializers.zeros
        channels = cfg.conv_channels
        dw_kernel = param_with_axes(
            self, "conv_dw_kernel", normal, (cfg.cca_time0, channels), ("conv", "qk"), pdtype
        )
        dw_bias = param_with_axes(self, "conv_dw_bias", zeros, (channels,), ("qk",), pdtype)
        grouped_shape = (cfg.cca_time1, nq + nk, d, d)
        g_kernel = param_with_axes(
            self, "conv_grouped_kernel", normal, grouped_shape, ("conv", "qk_heads", "head_dim", None), pdtype
        )
        g_bias = param_with_axes(self, "conv_grouped_bias", zeros, (channels,), ("qk",), pdtype)
        conv_weights = tuple(w.astype(dtype) for w in (dw_kernel, dw_bias, g_kernel, g_bias))
        z = jnp.concatenate([q0, k0], axis=-1)
        vd = v_delayed_proj(a)
        vd_at_start = v_delayed_proj(jnp.zeros((1, 1, a.shape[-1]), dtype))
        segments = jnp.ones((batch, seq), jnp.int32) if segment_ids is None else segment_ids
        temp = param_with_axes(self, "temp", zeros, (nk,), ("kv_heads",), pdtype).astype(dtype)
        tables = rope_tables(positions, inv_freq, dtype, rope_scale)
        new_cache = None

        def queries_keys(conv):  # steps 5-6 from the convolution's output plus the step-2 residuals
            conv = conv.reshape(batch, seq, nq + nk, d)
            return _normalized_rotated(conv[:, :, :nq] + q_res, conv[:, :, nq:] + k_res, temp, tables)

        if mode == "plain" and self.hooks.plan(cfg).cca_qk == "kernel":  # steps 2-6 in one CPU custom call
            vd = _delayed_plain(vd, vd_at_start, segment_ids)
            q, k = _fused_plain(z, conv_weights, temp, tables, segment_ids, segments, queries_keys, cfg)
        else:
            temporal = (z, vd, vd_at_start, conv_weights, segment_ids, segments)
            conv, vd, new_cache = self._temporal(mode, *temporal, cache, index, token_mask)
            q, k = queries_keys(conv)
        v = jnp.concatenate([v_current, vd], axis=-1).reshape(batch, seq, nk, d)

        # Steps 7-8: causal GQA attention (sliding-window layers add their window), then o_proj.
        if cfg.has_sliding_layers:
            mask = mask.replace(window=window)
        if mode == "context":
            real = jnp.ones((batch, seq), jnp.int32) if token_mask is None else token_mask.astype(jnp.int32)
            out = self.hooks.context.attention(q, k, v, segments, real, mask.window)
        else:
            out, new_cache = self._attend_local(q, k, v, mask, cache, index, new_cache, window, window_mask)
        # recomputed under remat "minimal": only the residual scale's gradient reads the output
        return dense("o_proj", cfg.hidden_size, ("heads", "embed"), recomputed=True)(out), new_cache
