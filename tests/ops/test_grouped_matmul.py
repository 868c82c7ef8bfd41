"""The CPU grouped-GEMM custom call (``zaya_jax.ops.grouped_matmul``) equals ``jax.lax.ragged_dot``
in value and in both gradients: empty groups, one group holding every row, rows past the groups,
group sizes that overrun the rows, widths off the kernel's 8 x 32 register tile, contractions longer
than its 512-deep blocks (forward and weight gradient), and tiles split by columns. The sorted MoE
path runs it on CPU in both directions; bfloat16 keeps the blocked form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.model.experts import dense_experts, sorted_experts
from zaya_jax.ops.grouped_matmul import FORWARD, WEIGHT_GRAD, available, cpu_grouped_matmul


def _value_and_grads(fn, x, w, group_sizes, probe):
    loss = lambda x, w: jnp.sum(fn(x, w, group_sizes) * probe)  # noqa: E731
    return jax.jit(fn)(x, w, group_sizes), jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


def _case(rows, k, n, sizes, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, n)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), probe


def _check(rows, k, n, sizes, seed=0):
    x, w, group_sizes, probe = _case(rows, k, n, sizes, seed)
    got, got_grads = _value_and_grads(cpu_grouped_matmul, x, w, group_sizes, probe)
    ref, ref_grads = _value_and_grads(jax.lax.ragged_dot, x, w, group_sizes, probe)
    scale = float(np.sqrt(k))  # a dot of k unit normals
    np.testing.assert_allclose(got, ref, atol=2e-5 * scale, rtol=0)
    covered = min(rows, int(np.sum(np.maximum(sizes, 0))))
    assert np.all(np.asarray(got)[covered:] == 0)  # rows past the groups
    for name, a, b in zip(("dx", "dw"), got_grads, ref_grads, strict=True):
        depth = max(n, max(sizes, default=1))  # dw contracts over a group's rows
        np.testing.assert_allclose(a, b, atol=2e-5 * float(np.sqrt(depth)), rtol=0, err_msg=name)
    return got, got_grads


def test_the_custom_calls_are_built_and_in_the_program():
    assert available(), (
        "the CPU library lacks zaya_grouped_matmul*: rebuild with python custom_calls/build.py"
    )
    x, w, group_sizes, probe = _case(64, 16, 24, (30, 0, 20))
    loss = lambda x, w: jnp.sum(cpu_grouped_matmul(x, w, group_sizes) * probe)  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    assert FORWARD in text and WEIGHT_GRAD in text and "ragged_dot" not in text


@pytest.mark.parametrize(
    "sizes",
    [
        (0, 0, 0, 0),  # every row past the groups (all skip-routed)
        (200, 0, 3, 64),  # an empty group, partial tiles, 33 rows past the end
        (300, 0, 0, 0),  # one group takes everything
        (1, 1, 1, 1),
        (250, 100, 0, 0),  # the sizes overrun the rows: the second group is cut at row 300
    ],
)
def test_group_layouts_equal_ragged_dot(sizes):
    _check(300, 24, 40, sizes, seed=sum(sizes))


@pytest.mark.parametrize(
    ("rows", "k", "n", "sizes"),
    [
        (70, 600, 33, (40, 30)),  # contraction past one 512-deep block: the forward accumulates
        (1100, 8, 70, (1030, 70)),  # a group 1030 rows deep: the weight gradient accumulates
        (40, 5, 1, (17, 23)),  # a single output column, a contraction below the 8-row tile
        (600, 64, 300, (600,)),  # few row tiles: the columns are split across items
    ],
)
def test_shapes_off_the_register_tile_and_long_contractions(rows, k, n, sizes):
    _check(rows, k, n, sizes)


def test_it_refuses_other_dtypes():
    x, w, group_sizes, _ = _case(8, 4, 4, (8,))
    with pytest.raises(TypeError, match="float32"):
        cpu_grouped_matmul(x.astype(jnp.bfloat16), w, group_sizes)


def _routing(dtype, rows=256, width=32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, width)), dtype)
    choice = jnp.asarray(rng.integers(0, 5, size=rows), jnp.int32)  # 4 experts and the skip class
    wi = jnp.asarray(rng.normal(size=(4, width, 16)) / 6, dtype)
    wo = jnp.asarray(rng.normal(size=(4, 8, width)) / 2, dtype)
    return x, choice, jnp.ones(rows, dtype), wi, wo, "silu"


def test_the_sorted_path_runs_it_on_cpu_and_equals_the_dense_definition():
    """With the kernel plan's ``moe_gemm: kernel``; without it the blocked form, no custom call."""
    args = _routing(jnp.float32)
    fn = jax.jit(sorted_experts, static_argnums=(5, 6))

    def text(kernel):
        loss = lambda x, wi, wo: jnp.sum(sorted_experts(x, args[1], args[2], wi, wo, "silu", kernel) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(args[0], args[3], args[4]).as_text()

    with_kernel = text(True)
    assert with_kernel.count(FORWARD) >= 2 and WEIGHT_GRAD in with_kernel and "ragged_dot" not in with_kernel
    assert FORWARD not in text(False)
    np.testing.assert_allclose(fn(*args, True), dense_experts(*args), atol=1e-5, rtol=1e-5)


def test_bfloat16_keeps_the_blocked_form():
    args = _routing(jnp.bfloat16)
    lowered = jax.jit(sorted_experts, static_argnums=(5, 6)).lower(*args, True)
    assert FORWARD not in lowered.as_text()
    assert lowered.as_text(debug_info=True).count('"blocked_grouped_matmul') > 0
    np.testing.assert_allclose(
        np.asarray(lowered.compile()(*args[:5]), np.float32),
        np.asarray(dense_experts(*args), np.float32),
        atol=0.05,
    )
