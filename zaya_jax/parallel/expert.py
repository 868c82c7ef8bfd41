"""Expert parallelism: experts split over the ``expert`` mesh axis, tokens sent to their expert's
device and back with two ``all_to_all`` exchanges inside a ``shard_map``.

Each device holds E / |expert| experts and its own tokens (the batch is split over the expert
axis too). Per destination device a token buffer of ``capacity`` rows is exchanged: tokens beyond
it are dropped (no expert output, counted in ``dropped``); ``mesh.expert_capacity_factor = 0``
makes the capacity the local token count, which is dropless. On the receiving side the local
experts run as one grouped matmul over tokens sorted by expert (``jax.lax.ragged_dot``).

``jax.lax.ragged_all_to_all`` (exchanging only the rows actually routed) is not implemented on
XLA:CPU; the padded exchange here runs everywhere and is what the CPU tests check.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from zaya_jax.model.experts import sorted_experts
from zaya_jax.parallel.rules import BATCH_AXES


def pair_capacity(tokens: int, devices: int, capacity_factor: float) -> int:
    """Rows per (source, destination) pair: all local tokens when ``capacity_factor <= 0``."""
    if capacity_factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens / devices)))


def _local_moe(
    x, choice, weight, wi, wo, *, act: str, num_experts: int, devices: int, capacity_factor: float
):
    """One device's part. x: (b, t, H) local tokens; wi, wo: this device's E/devices experts."""
    b, t, hidden = x.shape
    n = b * t
    local_experts = num_experts // devices
    x, choice, weight = x.reshape(n, hidden), choice.reshape(n), weight.reshape(n)
    routed = choice < num_experts  # the skip class goes nowhere
    dest = jnp.where(routed, choice // local_experts, devices)
    capacity = pair_capacity(n, devices, capacity_factor)

    # Rank of each token among those going to the same device (stable, in token order).
    onehot = jax.nn.one_hot(dest, devices, dtype=jnp.int32)
    rank = jnp.take_along_axis(
        jnp.cumsum(onehot, axis=0) - 1, jnp.minimum(dest, devices - 1)[:, None], axis=1
    )[:, 0]
    kept = routed & (rank < capacity)
    row = jnp.where(kept, dest, devices)  # out of bounds -> dropped by the scatter
    send_x = jnp.zeros((devices, capacity, hidden), x.dtype).at[row, rank].set(x, mode="drop")
    send_e = (
        jnp.full((devices, capacity), local_experts, jnp.int32)
        .at[row, rank]
        .set(choice % local_experts, mode="drop")
    )

    recv_x = jax.lax.all_to_all(send_x, "expert", 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, "expert", 0, 0, tiled=True)
    # Empty slots carry expert id ``local_experts``: sorted last, outside every group, output 0.
    flat = recv_x.reshape(devices * capacity, hidden)
    ones = jnp.ones((devices * capacity,), x.dtype)
    out = sorted_experts(flat, recv_e.reshape(-1), ones, wi, wo, act).reshape(devices, capacity, hidden)
    back = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True)

    result = back.at[jnp.minimum(dest, devices - 1), jnp.minimum(rank, capacity - 1)].get()
    result = jnp.where(kept[:, None], result * weight[:, None], 0)
    return result.reshape(b, t, hidden), (routed & ~kept).reshape(b, t)


def expert_dispatch(mesh: Mesh, capacity_factor: float = 0.0) -> Any:
    """The ``moe_dispatch`` hook for :class:`zaya_jax.model.Zaya` on ``mesh``:
    ``(m, choice, weight, wi, wo, act) -> (out, dropped)`` with m (batch, seq, embed) global."""
    devices = mesh.shape["expert"]
    rows = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1) or None
    seq = "context" if mesh.shape["context"] > 1 else None
    tokens = PartitionSpec(rows, seq, None)
    per_token = PartitionSpec(rows, seq)
    experts = PartitionSpec("expert", None, None)

    def dispatch(m, choice, weight, wi, wo, act):
        fn = jax.shard_map(
            functools.partial(
                _local_moe, act=act, num_experts=wi.shape[0], devices=devices, capacity_factor=capacity_factor
            ),
            mesh=mesh,
            in_specs=(tokens, per_token, per_token, experts, experts),
            out_specs=(tokens, per_token),
        )
        return fn(m, choice, weight, wi, wo)

    return dispatch
