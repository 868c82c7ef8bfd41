"""SwiGLU experts and the three MoE compute paths (spec §2.4), all equal where nothing is dropped.

* ``dense``: every expert on every token, combined with a one-hot; the reference for tests.
* ``sorted``: dropless; tokens sorted by expert and run through ``jax.lax.ragged_dot`` (on CPU the
  grouped-GEMM custom call, :mod:`zaya_jax.ops.grouped_matmul`, in float32 where the kernel plan
  takes it; otherwise a blocked equivalent, :func:`blocked_grouped_matmul`). Skip-routed
  tokens sort after every real expert and fall outside all groups, so they cost nothing.
* ``capacity``: per sequence, ``capacity_factor`` x tokens / E slots per expert, filled in
  arrival order; tokens gathered into an expert-major (E, C, embed) buffer and run as one batched
  GEMM per projection (no one-hot dispatch tensor); tokens past an expert's capacity get no expert
  output and are counted in ``dropped``.

Tokens routed to the skip class (``choice == E``) get 0 from every path; ``Block`` adds the
``scaled_input`` variant on top when configured.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from zaya_jax.model.layers import param_with_axes
from zaya_jax.model.mesh_hooks import MoeDispatch
from zaya_jax.ops import grouped_matmul as cpu_grouped
from zaya_jax.ops.platform import platform_branch
from zaya_jax.ops.quantization import quantize_dequantize

_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
}


def _swiglu(h: jax.Array, act: str) -> jax.Array:
    gate, up = jnp.split(h, 2, axis=-1)
    return _ACTIVATIONS[act](gate) * up


def dense_experts(x, choice, weight, wi, wo, act):
    """x: (tokens, embed); choice, weight: (tokens,); wi: (E, embed, 2I); wo: (E, I, embed)."""
    hidden = _swiglu(jnp.einsum("th,ehf->tef", x, wi), act)
    out = jnp.einsum("tei,eih->teh", hidden, wo)
    combine = jax.nn.one_hot(choice, wi.shape[0], dtype=x.dtype) * weight[:, None]
    return jnp.einsum("teh,te->th", out, combine)


CPU_GROUP_BLOCK = 128
"""Rows per matmul of the CPU grouped matmul; each group wastes less than one block."""


def blocked_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot`` computed block by block: the rows of each group are moved to a
    buffer where every group starts on a multiple of ``CPU_GROUP_BLOCK`` rows, then all blocks go
    through one batched matmul, each block with its group's weights (gathered per block).

    x: (rows, K) sorted by group; w: (groups, K, N); group_sizes: (groups,) int. Rows past
    ``sum(group_sizes)`` get zeros, as in ``ragged_dot``. XLA:CPU lowers ``ragged_dot`` to a dense
    masked matmul over every group (``groups`` times the work); this does (rows + groups * block)
    rows of work. One batched matmul instead of a loop over blocks (``lax.map``): 0.7x the time of
    the loop at the ``tiny`` shape, for a copy of the weights per block, which is small for the
    models a CPU trains. Gradients by autodiff.
    """
    block = CPU_GROUP_BLOCK
    rows, k = x.shape
    groups, _, n = w.shape
    num_blocks = -(-rows // block) + groups  # static bound: each group wastes < 1 block
    total = num_blocks * block
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded = (group_sizes + block - 1) // block * block
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    row = jnp.arange(rows)
    # compare_all: (rows x groups) comparisons, vectorised, instead of a binary-search loop
    row_group = jnp.searchsorted(ends, row, side="right", method="compare_all")  # groups: past the end
    valid = row_group < groups
    group = jnp.minimum(row_group, groups - 1)
    dest = jnp.where(valid, padded_starts[group] + row - starts[group], total)  # total: dropped
    buffer = jnp.zeros((total, k), x.dtype).at[dest].set(x, mode="drop", unique_indices=True)
    block_group = jnp.searchsorted(
        padded_ends, jnp.arange(num_blocks) * block, side="right", method="compare_all"
    )
    block_group = jnp.minimum(block_group, groups - 1)  # blocks past the last group hold zeros
    out = jnp.einsum("bmk,bkn->bmn", buffer.reshape(num_blocks, block, k), w[block_group])
    out = out.reshape(total, n)
    return jnp.where(valid[:, None], out[jnp.minimum(dest, total - 1)], 0).astype(x.dtype)


def ragged_dot_memory_twin(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Planning stand-in for ``ragged_dot`` as a GPU runs it (one grouped GEMM): the same operands,
    result and FLOPs, computed as ``x @ w[0]``, whose gradients (``g @ w[0]^T`` and a (E, K, N)
    weight gradient) have the grouped GEMM's buffers too. Written as a batched dot (a batch of
    one) so that remat policies treat it as they treat ``ragged_dot`` (not a plain weight matmul:
    ``minimal`` recomputes it). XLA:CPU would expand the real op into one dense product per group
    (E times the memory), so a plan compiled on CPU uses this (``zaya_jax.ops.platform``); never
    used to compute."""
    del group_sizes
    with jax.named_scope("ragged_dot_gpu_twin"):
        return jnp.einsum("bmk,bkn->bmn", x[None], w[:1])[0]


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, kernel: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot`` (a grouped GEMM on GPUs); on CPU the grouped-GEMM custom call
    (:mod:`zaya_jax.ops.grouped_matmul`, float32) where ``kernel`` (the plan's ``moe_gemm``), else
    :func:`blocked_grouped_matmul`; while planning a GPU program on CPU, :func:`ragged_dot_memory_twin`."""

    def on_cpu(x, w, group_sizes):
        if kernel and x.dtype == w.dtype == jnp.float32:
            with jax.named_scope("grouped_matmul_cpu"):
                return cpu_grouped.cpu_grouped_matmul(x, w, group_sizes)
        with jax.named_scope("blocked_grouped_matmul"):
            return blocked_grouped_matmul(x, w, group_sizes)

    return platform_branch(
        x, w, group_sizes, cpu=on_cpu, gpu=jax.lax.ragged_dot, gpu_twin=ragged_dot_memory_twin
    )


def sorted_experts(x, choice, weight, wi, wo, act, kernel: bool = False):
    """Dropless grouped matmul over tokens sorted by expert (skip class E sorts last, outside
    groups); ``kernel``: :func:`grouped_matmul`'s."""
    num_experts = wi.shape[0]
    order = jnp.argsort(choice, stable=True)
    group_sizes = jnp.bincount(choice, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    hidden = _swiglu(grouped_matmul(x[order], wi, group_sizes, kernel), act)
    out = grouped_matmul(hidden, wo, group_sizes, kernel) * weight[order][:, None]
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True)


def _expert_major(x, choice, weight, wi, wo, act, capacity: int):
    """One group: tokens (t, embed) gathered into an expert-major (E, C, embed) buffer, slots filled
    in arrival order, then one batched GEMM per projection and a gather back. Returns
    (out (t, embed), dropped (t,))."""
    num_experts, tokens = wi.shape[0], x.shape[0]
    order = jnp.argsort(choice, stable=True)  # by expert, arrival order within; skip class last
    counts = jnp.bincount(choice, length=num_experts + 1)[:num_experts]
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(capacity)
    source = order[jnp.minimum(starts[:, None] + slot, tokens - 1)]  # (E, C) token in each slot
    filled = slot < counts[:, None]
    expert_in = jnp.where(filled[..., None], x[source], 0)  # (E, C, embed)
    hidden = _swiglu(jnp.einsum("ech,ehf->ecf", expert_in, wi), act)
    expert_out = jnp.einsum("ecf,efh->ech", hidden, wo)
    expert = jnp.minimum(choice, num_experts - 1)
    rank = jnp.zeros_like(choice).at[order].set(jnp.arange(tokens) - starts[expert[order]])
    kept = (choice < num_experts) & (rank < capacity)
    out = expert_out[expert, jnp.minimum(rank, capacity - 1)] * (weight * kept)[:, None]
    return out.astype(x.dtype), (choice < num_experts) & ~kept


def capacity_experts(x, choice, weight, wi, wo, act, capacity: int):
    """``capacity`` slots per expert per group, expert-major: each group's tokens are gathered into
    an (E, C, embed) buffer by their rank in their expert's queue (arrival order), the experts run
    as one batched GEMM per projection over (groups x E) batches, and each token gathers its slot
    back. No one-hot (tokens x E x C) dispatch tensor: buffers are (groups, E, C, embed), i.e.
    ``capacity_factor`` x the tokens' activations.

    x: (groups, tokens, embed); choice, weight: (groups, tokens). Returns (out, dropped) where
    ``dropped`` (groups, tokens) marks routed tokens that found no free slot.
    """
    return jax.vmap(lambda *a: _expert_major(*a, wi, wo, act, capacity))(x, choice, weight)


def one_hot_capacity_experts(x, choice, weight, wi, wo, act, capacity: int):
    """The capacity path's definition as one-hot (groups, tokens, E, C) dispatch and combine
    einsums, as it was computed before :func:`capacity_experts`: the reference its tests and
    ``bench/moe_paths.py`` compare against (outputs only; drops are :func:`capacity_experts`')."""
    routed = jax.nn.one_hot(choice, wi.shape[0], dtype=jnp.int32)
    slot = jnp.cumsum(routed, axis=1) * routed - 1
    kept = routed * (slot < capacity)
    dispatch = (kept[..., None] * jax.nn.one_hot(slot, capacity, dtype=jnp.int32)).astype(x.dtype)
    expert_in = jnp.einsum("gtec,gth->egch", dispatch, x)
    expert_out = jnp.einsum("egcf,efh->egch", _swiglu(jnp.einsum("egch,ehf->egcf", expert_in, wi), act), wo)
    return jnp.einsum("gtec,egch->gth", dispatch * weight[..., None, None], expert_out)


class Experts(nn.Module):
    """E SwiGLU experts; m: (batch, seq, embed); choice, weight: (batch, seq) -> (out, dropped (batch, seq))."""

    cfg: ModelConfig
    # Optional replacement of the local paths, e.g. expert parallelism over a mesh
    # (``zaya_jax.parallel.expert``); the model itself knows no mesh.
    dispatch: MoeDispatch | None = None
    grouped_kernel: bool = False  # the kernel plan's moe_gemm is "kernel"

    @nn.compact
    def __call__(self, m: jax.Array, choice: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        experts, embed, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nn.initializers.normal(cfg.initializer_range)
        # wi fuses [gate | up] along its last axis (HF gate_up_proj rows [0, I) and [I, 2I)).
        wi = param_with_axes(
            self, "wi", init, (experts, embed, 2 * inner), ("experts", "embed", "expert_mlp"), pdtype
        )
        wo = param_with_axes(
            self, "wo", init, (experts, inner, embed), ("experts", "expert_mlp", "embed"), pdtype
        )
        # as a quantized export holds them (inputs: wi's embed axis, wo's expert_mlp axis)
        wi = quantize_dequantize(wi, cfg.expert_quantization, axis=1).astype(dtype)
        wo = quantize_dequantize(wo, cfg.expert_quantization, axis=1).astype(dtype)
        m, weight = m.astype(dtype), weight.astype(dtype)
        batch, seq, _ = m.shape

        if self.dispatch is not None:
            return self.dispatch(m, choice, weight, wi, wo, cfg.hidden_act)
        if cfg.moe_impl == "capacity":
            return capacity_experts(m, choice, weight, wi, wo, cfg.hidden_act, cfg.capacity(seq))
        flat = (m.reshape(batch * seq, embed), choice.reshape(-1), weight.reshape(-1), wi, wo, cfg.hidden_act)
        # "auto" is resolved by the run's programs (zaya_jax.programs.moe); traced unresolved, sorted
        out = dense_experts(*flat) if cfg.moe_impl == "dense" else sorted_experts(*flat, self.grouped_kernel)
        return out.reshape(batch, seq, embed), jnp.zeros((batch, seq), bool)
