"""Muon: momentum orthogonalised by a Newton-Schulz iteration, per leaf over its matrix axes.

Numerically this follows ``optax.contrib.scale_by_muon`` + ``scale_by_shape`` (optax 0.2.8) with
``preconditioning="frobenius"`` so the two are interchangeable (a test asserts it): Adam-style bias
correction of the momentum, Nesterov mixing ``beta * mu_hat + (1 - beta) * g_hat``, Frobenius
normalisation before the iteration, the transposition of tall matrices, and the width scaling
``sqrt(max(1, fan_out / fan_in))`` or Moonlight's ``consistent_rms * sqrt(max(fan_in, fan_out))``.

What differs is the layout: instead of a ``vmap`` per leaf, each leaf's batch axes (``layers``,
``experts``, ...) are moved to the front and flattened, so the iteration runs as batched matmuls on
one (stack, A, B) array per leaf. That is the stacked, owner-friendly layout the distributed plan
builds on (shard the stack axis and every matrix's iteration is device-local).

Newton-Schulz runs on float32 arrays whatever the gradient dtype (bfloat16 storage would round
the iterate every step), and the result is cast back to the gradient's dtype. The matmuls follow
``jax_default_matmul_precision``: on NVIDIA GPUs float32 matmuls default to TF32, which is what makes
the iteration fast (H200: one layer's expert stack wi, 16 x 2048 x 4096, in 22.7 ms).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from zaya_jax.config import NS_COEFFS
from zaya_jax.ops import newton_schulz_cpu
from zaya_jax.ops.newton_schulz import (
    full_float32_matmuls,
    newton_schulz_gram_reference,
    newton_schulz_iterations,
    resolve_formulation,
)
from zaya_jax.ops.platform import platform_branch
from zaya_jax.optim.groups import LeafGroup, is_leaf_group

DEFAULT_NS_COEFFS = NS_COEFFS  # Keller Jordan's quintic (a, b, c), zaya_jax.config.NS_COEFFS

NS_EPS = 1e-8
"""Added to the Frobenius norm before dividing by it (optax's default ``eps``)."""

IMPLS = ("jax", "kernel")
"""What runs the iteration (the kernel plan's ``newton_schulz``, :mod:`zaya_jax.ops.kernel_plan`):
``jax``: XLA's loop on every platform, no custom call (the formulations' own reference);
``kernel``: the platform's custom call: on a CPU each matrix's whole iteration as one work item
(:mod:`zaya_jax.ops.newton_schulz_cpu`, either formulation), on a GPU the fused
``zaya_newton_schulz`` (standard formulation)."""


def newton_schulz(
    x: jax.Array,
    coeffs: Sequence[float] = DEFAULT_NS_COEFFS,
    steps: int = 5,
    eps: float = NS_EPS,
    impl: str = "jax",
    formulation: str = "auto",
) -> jax.Array:
    """Approximate the orthogonal polar factor U V^T of each matrix of ``x`` (quintic Newton-Schulz).

    x: (..., A, B), any float dtype; leading axes are a batch of independent matrices.
    Returns float32 (..., A, B) whose singular values lie in about [0.68, 1.14], except those far
    below the largest (< ~1e-3 of the Frobenius norm) which 5 steps cannot lift: the coefficients
    trade exact convergence for a steep slope (3.4) at zero. Tall matrices (A > B) iterate on their
    transpose so the Gram matrix is the smaller B x B, as optax does.

    ``impl``: see :data:`IMPLS`. ``formulation``: ``standard`` iterates on X; ``gram`` on the Gram
    matrix, X read twice per 3-step segment (fewer FLOPs when the long side is > 5/3 of the short
    one); ``auto`` picks per shape, statically: in XLA's loop gram when a wide matrix's long side is
    >= 4x the short one and float32 matmuls run at full precision (CPU, ``highest``,
    ``zaya_jax.ops.newton_schulz``); in the CPU call the one with fewer FLOPs (gram from a long side
    of ~1.4x the short one at 128), within float32 rounding of the loop
    (``tests/ops/test_newton_schulz_cpu.py`` states the bound).
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs (..., A, B) matrices, got shape {x.shape}")
    if impl not in IMPLS:
        raise ValueError(f"unknown Newton-Schulz impl {impl!r}; use one of {IMPLS}")
    if len(coeffs) != 3:
        raise ValueError(f"Newton-Schulz coefficients must be 3 numbers (a, b, c), got {list(coeffs)}")
    x = x.astype(jnp.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    # Frobenius >= spectral norm: every singular value lands in [0, 1], the range f is tuned for.
    norm = jnp.linalg.norm(x, ord="fro", axis=(-2, -1), keepdims=True) + eps
    if impl == "jax":
        x = _jax_iteration(x, norm, coeffs=tuple(coeffs), steps=steps, formulation=formulation, tall=tall)
    else:
        # On CPU the whole iteration of each matrix is one work item of a custom call (every step
        # on data in that core's cache, the symmetric products halved): tiny's Muon leaves in
        # 0.40-0.57x the time of the JAX loop (bench/RESULTS.md).
        def on_cpu(x, norm):
            return newton_schulz_cpu.cpu_newton_schulz(x / norm, steps, tuple(coeffs), formulation)

        def on_gpu(x, norm):  # the fused call runs the standard iteration (the plan refuses gram)
            if formulation == "gram":
                return _jax_iteration(
                    x, norm, coeffs=tuple(coeffs), steps=steps, formulation="gram", tall=tall
                )
            return newton_schulz_iterations(x / norm, steps, coeffs, impl="custom", formulation="standard")

        x = platform_branch(x, norm, cpu=on_cpu, gpu=on_gpu)
    return jnp.swapaxes(x, -1, -2) if tall else x


def _jax_iteration(
    x: jax.Array,
    norm: jax.Array,
    *,
    coeffs: tuple[float, ...],
    steps: int,
    formulation: str,
    tall: bool,
) -> jax.Array:
    """The iteration as JAX operations on wide float32 ``x`` (transposed when ``tall``) and its norm."""
    chosen = resolve_formulation(formulation, *x.shape[-2:], full_float32_matmuls())
    if chosen == "gram" and not (tall and formulation == "auto"):
        # The normalisation folded into G and Q. ``auto`` leaves tall matrices to the standard
        # loop: their Gram updates differed by ~1e-9 between the per-device (shard_map) and the
        # single-device optimizer under the tests' XLA:CPU flags (tests/parallel), which must be
        # bit-identical; the barrier keeps a transposed X from being folded into the matmuls.
        a, b, c = (float(v) for v in coeffs)
        if tall:
            x = jax.lax.optimization_barrier(x)
        return newton_schulz_gram_reference(x, steps, a, b, c, norm=norm)
    x = x / norm
    # The reference is a rolled loop: unlike optax 0.2.8's unrolled one, it keeps XLA from
    # scheduling many leaves' iterations side by side: the ZAYA1-8B update's temporaries drop from
    # 42.7 to 30.0 GiB on an H200. The price is float32 rounding-level differences from optax
    # (~1e-7). The Gram formulation keeps that property: its steps and its restart's blocks are
    # rolled loops too.
    return newton_schulz_iterations(x, steps, coeffs, impl="reference", formulation="standard")


def orthogonalize(
    x: jax.Array,
    matrix_axes: tuple[int, int],
    coeffs: Sequence[float] = DEFAULT_NS_COEFFS,
    steps: int = 5,
    eps: float = NS_EPS,
    impl: str = "jax",
    formulation: str = "auto",
) -> jax.Array:
    """Newton-Schulz over the (input, output) ``matrix_axes`` of ``x``, every other axis a batch axis.

    x: any rank >= 2, e.g. (layers, experts, embed, expert_mlp) with matrix_axes (2, 3). The batch
    axes are moved to the front (in order) and flattened, giving one (stack, in, out) array; the
    result is float32 in ``x``'s layout.
    """
    if x.ndim < 2:
        raise ValueError(f"Muon leaves need rank >= 2, got shape {x.shape}")
    fan_in_axis, fan_out_axis = (ax % x.ndim for ax in matrix_axes)
    if fan_in_axis == fan_out_axis:
        raise ValueError(f"matrix_axes {matrix_axes} name the same axis of a rank-{x.ndim} leaf")
    batch_axes = [i for i in range(x.ndim) if i not in (fan_in_axis, fan_out_axis)]
    perm = (*batch_axes, fan_in_axis, fan_out_axis)
    moved = jnp.transpose(x, perm)
    stacked = moved.reshape(-1, *moved.shape[-2:])
    ortho = newton_schulz(stacked, coeffs, steps, eps, impl, formulation).reshape(moved.shape)
    return jnp.transpose(ortho, tuple(np.argsort(perm)))


def orthogonalize_sharded(
    x: jax.Array,
    matrix_axes: tuple[int, int],
    sharding: NamedSharding,
    coeffs: Sequence[float] = DEFAULT_NS_COEFFS,
    steps: int = 5,
    eps: float = NS_EPS,
    impl: str = "jax",
    formulation: str = "auto",
) -> jax.Array:
    """:func:`orthogonalize` of a leaf laid out as ``sharding``, with no collective inside the
    Newton-Schulz iteration: each device iterates on whole matrices, its own share of the stack.

    The mesh axes that split the matrix axes (e.g. ``fsdp`` on the residual width) are moved onto a
    batch axis (layers, experts) that they divide, so the devices of an FSDP group orthogonalise
    different matrices instead of all gathering and iterating on the same ones; one exchange on
    entry and one on exit (``shard_map`` specs and a sharding constraint) move the data. When no
    batch axis divides, the matrix axes are gathered and the batch axes stay split as stored.

    Left to GSPMD, the partitioner splits every NS matmul instead and communicates in each iteration.
    """
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    matrix = {axis % x.ndim for axis in matrix_axes}

    def names(entry) -> tuple[str, ...]:
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    moved = [name for axis in sorted(matrix) for name in names(spec[axis])]
    for axis in matrix:
        spec[axis] = None
    if moved:
        size = int(np.prod([sharding.mesh.shape[name] for name in moved]))
        for axis in range(x.ndim):
            if axis in matrix:
                continue
            held = int(np.prod([sharding.mesh.shape[name] for name in names(spec[axis])]))
            if x.shape[axis] % (held * size) == 0:
                spec[axis] = (*names(spec[axis]), *moved)
                break
    local = PartitionSpec(*spec)
    fn = jax.shard_map(
        functools.partial(
            orthogonalize,
            matrix_axes=matrix_axes,
            coeffs=coeffs,
            steps=steps,
            eps=eps,
            impl=impl,
            formulation=formulation,
        ),
        mesh=sharding.mesh,
        in_specs=local,
        out_specs=local,
    )
    return jax.lax.with_sharding_constraint(fn(x), sharding)


def shape_scale(
    shape: Sequence[int], matrix_axes: tuple[int, int], consistent_rms: float | None = None
) -> jax.Array:
    """The factor an orthogonalised update is multiplied by (float32 scalar).

    Default (Keller Jordan, optax): sqrt(max(1, fan_out / fan_in)). With ``consistent_rms`` c
    (Moonlight): c * sqrt(max(fan_in, fan_out)), which gives updates the RMS of AdamW's (c = 0.2).
    """
    fan_in, fan_out = shape[matrix_axes[0]], shape[matrix_axes[1]]
    if consistent_rms is None:
        return jnp.sqrt(jnp.maximum(1, fan_out / fan_in))
    return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms


class MuonState(NamedTuple):
    """count: () int32 updates so far; mu: momentum, ``optax.MaskedNode`` on non-Muon leaves."""

    count: jax.Array
    mu: optax.Updates


def _muon_leaves(groups_tree: dict[str, Any], tree: optax.Updates) -> optax.Updates:
    """``tree`` with every non-Muon leaf replaced by ``optax.MaskedNode`` (an empty subtree)."""
    return jax.tree.map(
        lambda g, x: x if g.group == "muon" else optax.MaskedNode(), groups_tree, tree, is_leaf=is_leaf_group
    )


def _check_settings(beta: float, ns_coeffs: Sequence[float], ns_steps: int) -> None:
    if len(ns_coeffs) != 3:
        raise ValueError(f"ns_coeffs must be 3 numbers (a, b, c), got {list(ns_coeffs)}")
    if ns_steps < 1:
        raise ValueError(f"ns_steps={ns_steps} must be >= 1")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"Muon momentum beta={beta} must be in [0, 1)")


def _check_leaf(group: LeafGroup, p: jax.Array | optax.MaskedNode) -> None:
    """A Muon leaf must have the matrix axes its group names."""
    if group.group != "muon" or isinstance(p, optax.MaskedNode):
        return
    if p.ndim < 2 or max(group.matrix_axes) >= p.ndim:
        raise ValueError(
            f"a Muon leaf of shape {p.shape} cannot have matrix axes {group.matrix_axes}; "
            "the groups tree does not describe these parameters"
        )


def scale_by_muon(
    groups_tree: dict[str, Any],
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_coeffs: Sequence[float] = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    eps: float = NS_EPS,
    consistent_rms: float | None = None,
    mu_dtype: jnp.dtype | None = None,
    shardings: dict[str, Any] | None = None,
    newton_schulz: str = "jax",
    ns_formulation: str = "auto",
) -> optax.GradientTransformation:
    """Muon's direction: momentum -> Newton-Schulz over each leaf's matrix axes -> shape scaling.

    ``groups_tree``: :class:`LeafGroup` per parameter (``param_groups``). Only ``"muon"`` leaves
    are transformed and get momentum; others pass through unchanged (inside ``optax.partition``
    they arrive as ``MaskedNode``). The learning rate and weight decay are applied after this
    (``build_optimizer``). ``mu_dtype``: momentum dtype, default the parameter's. ``shardings``:
    the parameters' NamedShardings (a tree like ``groups_tree``); when given, Newton-Schulz runs
    per device on gathered matrices (:func:`orthogonalize_sharded`). ``newton_schulz``: what runs
    the iteration (:data:`IMPLS`; the kernel plan's, ``jax`` without one). ``ns_formulation``:
    ``auto`` (Gram iteration for leaves whose long side is >= 4x the short one), ``standard`` or
    ``gram`` (:func:`newton_schulz`).
    """
    _check_settings(beta, ns_coeffs, ns_steps)

    def init_fn(params: optax.Params) -> MuonState:
        jax.tree.map(_check_leaf, groups_tree, params, is_leaf=is_leaf_group)
        mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), _muon_leaves(groups_tree, params))
        return MuonState(count=jnp.zeros([], jnp.int32), mu=mu)

    def direction(
        group: LeafGroup,
        update: jax.Array | optax.MaskedNode,
        mu_hat: jax.Array | optax.MaskedNode,
        sharding: jax.sharding.Sharding | None = None,
    ) -> jax.Array | optax.MaskedNode:
        if group.group != "muon" or isinstance(update, optax.MaskedNode):
            return update
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            ortho = orthogonalize_sharded(
                mu_hat, group.matrix_axes, sharding, ns_coeffs, ns_steps, eps, newton_schulz, ns_formulation
            )
        else:
            ortho = orthogonalize(
                mu_hat, group.matrix_axes, ns_coeffs, ns_steps, eps, newton_schulz, ns_formulation
            )
        return (shape_scale(update.shape, group.matrix_axes, consistent_rms) * ortho).astype(update.dtype)

    def update_fn(
        updates: optax.Updates, state: MuonState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, MuonState]:
        del params
        grads = _muon_leaves(groups_tree, updates)
        mu = optax.tree.update_moment(grads, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        # Bias-corrected like optax (Keller Jordan's torch Muon has none): mu_hat is an unbiased
        # average from step 1, which matters for the Nesterov mix; NS's normalisation hides the rest.
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                optax.tree.bias_correction(grads, beta, count),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        if shardings is None:
            updates = jax.tree.map(direction, groups_tree, updates, mu_hat, is_leaf=is_leaf_group)
        else:
            updates = jax.tree.map(direction, groups_tree, updates, mu_hat, shardings, is_leaf=is_leaf_group)
        if mu_dtype is not None:
            mu = jax.tree.map(lambda m: m.astype(mu_dtype), mu)
        return updates, MuonState(count=count, mu=mu)

    return optax.GradientTransformation(init_fn, update_fn)
