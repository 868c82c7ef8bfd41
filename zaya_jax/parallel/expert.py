"""Expert parallelism: experts split over the ``expert`` mesh axis, tokens sent to their expert's
device and back with two ``all_to_all`` exchanges inside a ``shard_map``.

Each device holds E / |expert| experts and its own tokens (the batch is split over the expert
axis too). Per destination device a token buffer of ``capacity`` rows is exchanged: tokens beyond
it are dropped (no expert output, counted in ``dropped``); ``mesh.expert_capacity_factor = 0``
makes the capacity the local token count, which is dropless. On the receiving side the local
experts run as one grouped matmul over tokens sorted by expert (``jax.lax.ragged_dot``).

Two exchanges (``mesh.expert_exchange``):

- ``padded``: every (source, destination) pair sends ``capacity`` rows through ``all_to_all``,
  empty rows included. Runs on every platform.
- ``ragged``: tokens are sorted by destination and ``jax.lax.ragged_all_to_all`` sends only the
  rows actually routed (the counts go first, by a small ``all_to_all``); received rows land in the
  same per-source slots as the padded exchange, so both compute the same result. XLA:CPU does not
  implement the collective: the CPU tests run this path with :func:`emulated_ragged_all_to_all`,
  which has the collective's exact semantics, and check that the real collective is lowered.

``auto`` (the default) picks ``padded`` on CPU; on GPUs and TPUs ``ragged`` only once a
correctness probe on the live mesh passed (:func:`probed_exchange`: a small expert layer's
outputs, drops and gradients through ``ragged`` equal ``padded``'s): XLA:GPU's ragged all-to-all
has crashed above 32 ranks and corrupted a backward pass (openxla/xla#47283, #47868), so a
platform where it fails or differs falls back to ``padded`` with a warning, process 0's verdict
on every process.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from zaya_jax.model.experts import sorted_experts
from zaya_jax.model.mesh_hooks import MoeDispatch
from zaya_jax.ops.platform import planning_gpu_on_cpu, planning_target
from zaya_jax.parallel.rules import DEFAULT_RULES, batch_spec


def pair_capacity(tokens: int, devices: int, capacity_factor: float) -> int:
    """Rows per (source, destination) pair: all local tokens when ``capacity_factor <= 0``."""
    if capacity_factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens / devices)))


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``jax.lax.ragged_all_to_all`` with one slice per peer, built from a padded ``all_to_all``
    (each peer gets ``operand.shape[0]`` rows, masked to ``send_sizes``). For platforms without
    the collective (XLA:CPU) and for testing the offsets logic of the ragged exchange there."""
    peers, rows = input_offsets.shape[0], operand.shape[0]
    index = jnp.arange(rows)
    trailing = (1,) * (operand.ndim - 1)
    sent = (index[None, :] < send_sizes[:, None]).reshape(peers, rows, *trailing)
    chunks = jnp.where(
        sent, operand.at[input_offsets[:, None] + index[None, :]].get(mode="fill", fill_value=0), 0
    )
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    target = jnp.where(
        index[None, :] < recv_sizes[:, None], offsets[:, None] + index[None, :], output.shape[0]
    )
    return output.at[target.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")


def ragged_all_to_all_memory_twin(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """Planning stand-in for ``jax.lax.ragged_all_to_all`` as a GPU runs it: the operand travels
    once (one tiled ``all_to_all`` of its rows) into a result shaped like ``output``, so a plan
    compiled on CPU holds the collective's buffers, not the emulation's padded copies (which are
    peers x the operand). Moves the wrong rows: never used to compute (``zaya_jax.ops.platform``)."""
    del input_offsets, send_sizes, output_offsets, recv_sizes
    with jax.named_scope("ragged_all_to_all_gpu_twin"):
        peers = jax.lax.axis_size(axis_name)
        pad = [(0, (-operand.shape[0]) % peers)] + [(0, 0)] * (operand.ndim - 1)
        rows = jnp.pad(operand, pad).reshape(peers, -1, *operand.shape[1:])
        moved = jax.lax.all_to_all(rows, axis_name, 0, 0, tiled=True).reshape(-1, *operand.shape[1:])
        count = min(moved.shape[0], output.shape[0])
        return output.at[:count].add(moved[:count].astype(output.dtype))


EXCHANGES = {
    "ragged": jax.lax.ragged_all_to_all,
    "emulated": emulated_ragged_all_to_all,
    "planned": ragged_all_to_all_memory_twin,
}


def _local_moe_ragged(
    x,
    choice,
    weight,
    wi,
    wo,
    *,
    act: str,
    num_experts: int,
    devices: int,
    capacity_factor: float,
    exchange: str,
    kernel: bool = False,
):
    """One device's part with a ragged exchange: only routed rows travel. Same arguments and
    results as :func:`_local_moe_padded`."""
    ragged = functools.partial(EXCHANGES[exchange], axis_name="expert")
    b, t, hidden = x.shape
    n = b * t
    local_experts = num_experts // devices
    x, choice, weight = x.reshape(n, hidden), choice.reshape(n), weight.reshape(n)
    routed = choice < num_experts
    dest = jnp.where(routed, choice // local_experts, devices)  # ``devices``: not sent (skip)
    capacity = pair_capacity(n, devices, capacity_factor)

    order = jnp.argsort(dest, stable=True)  # grouped by destination, token order within a group
    dest_sorted = dest[order]
    counts = jnp.zeros((devices + 1,), jnp.int32).at[dest].add(1)[:devices]
    starts = jnp.cumsum(counts) - counts
    send_sizes = jnp.minimum(counts, capacity)
    recv_sizes = jax.lax.all_to_all(send_sizes, "expert", 0, 0, tiled=True)
    me = jax.lax.axis_index("expert")
    # Each source writes into its own ``capacity``-row slot on the receiver (as the padded path).
    slot = jnp.full((devices,), me * capacity, jnp.int32)
    buffer = ragged(
        x[order], jnp.zeros((devices * capacity, hidden), x.dtype), starts, send_sizes, slot, recv_sizes
    )
    ids = ragged(
        (choice % local_experts)[order],
        jnp.full((devices * capacity,), local_experts, jnp.int32),
        starts,
        send_sizes,
        slot,
        recv_sizes,
    )
    ones = jnp.ones((devices * capacity,), x.dtype)
    out = sorted_experts(buffer, ids, ones, wi, wo, act, kernel)

    # Back to each source, into the positions its rows were sent from.
    source_starts = jax.lax.all_to_all(starts, "expert", 0, 0, tiled=True)
    received_slots = jnp.arange(devices, dtype=jnp.int32) * capacity
    back = ragged(out, jnp.zeros((n, hidden), x.dtype), received_slots, recv_sizes, source_starts, send_sizes)

    rank = jnp.arange(n) - starts[jnp.minimum(dest_sorted, devices - 1)]
    kept_sorted = (dest_sorted < devices) & (rank < capacity)
    result = jnp.zeros_like(back).at[order].set(jnp.where(kept_sorted[:, None], back, 0))
    kept = jnp.zeros((n,), bool).at[order].set(kept_sorted)
    result = result * weight[:, None]
    return result.reshape(b, t, hidden), (routed & ~kept).reshape(b, t)


def _local_moe_padded(
    x,
    choice,
    weight,
    wi,
    wo,
    *,
    act: str,
    num_experts: int,
    devices: int,
    capacity_factor: float,
    kernel: bool = False,
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
    out = sorted_experts(flat, recv_e.reshape(-1), ones, wi, wo, act, kernel)
    out = out.reshape(devices, capacity, hidden)
    back = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True)

    result = back.at[jnp.minimum(dest, devices - 1), jnp.minimum(rank, capacity - 1)].get()
    result = jnp.where(kept[:, None], result * weight[:, None], 0)
    return result.reshape(b, t, hidden), (routed & ~kept).reshape(b, t)


def resolve_exchange(mesh: Mesh, exchange: str) -> str:
    """``auto`` -> ``ragged`` where the platform implements ``ragged_all_to_all`` and the probe on
    this mesh passed (:func:`probed_exchange`), else ``padded``. While a GPU program is planned on
    CPU (``zaya_jax.ops.platform.planning_for``), the ragged exchange is ``planned``:
    :func:`ragged_all_to_all_memory_twin`, which XLA:CPU can compile."""
    target = planning_target()
    if exchange == "ragged" or (exchange == "auto" and target == "gpu"):
        return "planned" if planning_gpu_on_cpu() else "ragged"
    if exchange != "auto":
        return exchange
    return probed_exchange(mesh)[0] if probes_exchange(mesh, exchange) else "padded"


def probes_exchange(mesh: Mesh, exchange: str) -> bool:
    """Whether ``exchange`` on ``mesh`` is decided by :func:`probed_exchange`: ``auto`` on a live
    accelerator (on CPU, or while planning, it is fixed)."""
    return exchange == "auto" and planning_target() is None and mesh.devices.flat[0].platform != "cpu"


def _probe_inputs(mesh: Mesh, experts: int, hidden: int = 32, ffn: int = 16):
    rows = math.prod(size for axis, size in mesh.shape.items() if axis in ("data", "fsdp", "expert"))
    rng = np.random.default_rng(0)
    m = rng.standard_normal((2 * rows, 16, hidden)).astype(np.float32)
    choice = rng.integers(0, experts + 1, size=(2 * rows, 16)).astype(np.int32)  # skip class included
    weight = rng.random((2 * rows, 16)).astype(np.float32)
    wi = (rng.standard_normal((experts, hidden, 2 * ffn)) / hidden**0.5).astype(np.float32)
    wo = (rng.standard_normal((experts, ffn, hidden)) / ffn**0.5).astype(np.float32)
    return m, choice, weight, wi, wo


def _probe_run(mesh: Mesh, exchange: str, inputs) -> list[np.ndarray]:
    dispatch = expert_dispatch(mesh, 0.0, exchange)
    m, choice, weight, wi, wo = inputs

    def loss(m, weight, wi, wo):
        out, dropped = dispatch(m, choice, weight, wi, wo, "silu")
        return jnp.sum(jnp.sin(out)), (out, dropped)

    grads, (out, dropped) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(m, weight, wi, wo)
    return [np.asarray(x, np.float64) for x in (out, dropped, *grads)]


@functools.cache
def probed_exchange(mesh: Mesh, candidate: str = "ragged", tolerance: float = 1e-4) -> tuple[str, str]:
    """(exchange, why): ``candidate`` if a small dropless expert layer on ``mesh`` runs through it
    with the outputs, drops and gradients of ``padded`` (each within ``tolerance`` of its largest
    entry), else ``padded`` with the failure or the difference. Once per mesh and process; every
    process takes process 0's verdict."""
    experts = 2 * mesh.shape["expert"]
    inputs = _probe_inputs(mesh, experts)
    try:
        want = _probe_run(mesh, "padded", inputs)
        got = _probe_run(mesh, candidate, inputs)
        worst = max(
            float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)
            for a, b in zip(got, want, strict=True)
        )
        ok, why = worst <= tolerance, f"{candidate} equals padded to {worst:.1e}"
        if not ok:
            why = f"{candidate} differs from padded by {worst:.1e} of the largest entry"
    except Exception as err:  # a collective this platform cannot compile or run
        ok, why = False, f"{candidate} failed: {' '.join(str(err).split())[:300]}"
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        agreed = bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))
        why, ok = (
            (why if agreed == ok else f"process 0's verdict ({'passed' if agreed else 'failed'})"),
            agreed,
        )
    if not ok:
        warnings.warn(f"mesh.expert_exchange auto: {why}; using the padded exchange", stacklevel=2)
    return (candidate if ok else "padded"), why


def expert_dispatch(
    mesh: Mesh,
    capacity_factor: float = 0.0,
    exchange: str = "auto",
    rules: Sequence[tuple[str, Any]] = DEFAULT_RULES,
    grouped_kernel: bool = False,
) -> MoeDispatch:
    """The ``moe_dispatch`` hook for :class:`zaya_jax.model.Zaya` on ``mesh``:
    ``(m, choice, weight, wi, wo, act) -> (out, dropped)`` with m (batch, seq, embed) global.
    ``exchange``: ``padded``, ``ragged``, ``emulated`` (ragged, emulated), ``planned`` (its memory
    twin, for plans only) or ``auto``; ``grouped_kernel``: the kernel plan's ``moe_gemm`` is
    ``kernel`` (:func:`~zaya_jax.model.experts.grouped_matmul`)."""
    devices = mesh.shape["expert"]
    exchange = resolve_exchange(mesh, exchange)
    if exchange == "padded":
        local_moe = _local_moe_padded
    elif exchange in EXCHANGES:
        local_moe = functools.partial(_local_moe_ragged, exchange=exchange)
    else:
        raise ValueError(f"unknown expert exchange {exchange!r}; use auto, padded, ragged or emulated")
    rows, seq = batch_spec(mesh, rules)
    tokens = PartitionSpec(rows, seq, None)
    per_token = PartitionSpec(rows, seq)
    experts = PartitionSpec("expert", None, None)

    def dispatch(m, choice, weight, wi, wo, act):
        fn = jax.shard_map(
            functools.partial(
                local_moe,
                act=act,
                num_experts=wi.shape[0],
                devices=devices,
                capacity_factor=capacity_factor,
                kernel=grouped_kernel,
            ),
            mesh=mesh,
            in_specs=(tokens, per_token, per_token, experts, experts),
            out_specs=(tokens, per_token),
        )
        return fn(m, choice, weight, wi, wo)

    return dispatch
