"""Our Muon equals optax.contrib.muon on the same leaves, and Newton-Schulz orthogonalises batched stacks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from zaya_jax.config import NS_COEFFS, OptimConfig
from zaya_jax.ops import newton_schulz_cpu
from zaya_jax.ops.newton_schulz import (
    full_float32_matmuls,
    gram_flops,
    newton_schulz_gram_reference,
    resolve_formulation,
    standard_flops,
)
from zaya_jax.optim import build_optimizer, learning_rate_schedule, newton_schulz, orthogonalize, param_groups

# A 2-D matrix, a layer-scanned tall stack, an expert stack, and AdamW leaves with and without decay.
AXES = {
    "matrix": ("heads", "embed"),
    "layer_stack": ("layers", "embed", "heads"),
    "experts": ("layers", "experts", "expert_mlp", "embed"),
    "embedding": ("vocab", "embed"),
    "norm": ("layers", "embed"),
    "bias": ("heads",),
}
SHAPES = {
    "matrix": (24, 16),  # tall: NS iterates on the transpose
    "layer_stack": (3, 16, 24),  # wide
    "experts": (2, 3, 40, 16),  # tall
    "embedding": (50, 16),
    "norm": (3, 16),
    "bias": (24,),
}
STEPS, TOTAL_STEPS = 5, 8
CFG = OptimConfig(
    muon_lr=0.02,
    adam_lr=3e-3,
    muon_weight_decay=0.1,
    adam_weight_decay=0.1,
    adam_b2=0.95,
    grad_clip=0.0,  # optax.contrib.muon does not clip
    warmup_steps=2,
    decay_fraction=0.25,
)


@pytest.fixture(autouse=True)
def _full_float32_matmuls():
    # GPUs default to TF32 for float32 matmuls; these comparisons are at float32 rounding level.
    with jax.default_matmul_precision("highest"):
        yield


def _random_tree(seed: int) -> dict[str, jax.Array]:
    key = jax.random.key(seed)
    return {
        name: jax.random.normal(jax.random.fold_in(key, i), s) for i, (name, s) in enumerate(SHAPES.items())
    }


def _train(tx: optax.GradientTransformation) -> dict[str, jax.Array]:
    """Params after STEPS updates on fixed random gradients (one compiled scan)."""
    grads = jax.tree.map(lambda *g: jnp.stack(g), *[_random_tree(100 + step) for step in range(STEPS)])

    def step(carry, g):
        params, state = carry
        updates, state = tx.update(g, state, params)
        return (optax.apply_updates(params, updates), state), None

    @jax.jit
    def train(params):
        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), grads)
        return params

    return train(_random_tree(0))


def _schedule(peak: float) -> optax.Schedule:
    return learning_rate_schedule("wsd", peak, TOTAL_STEPS, CFG.warmup_steps, CFG.decay_fraction, 0.0)


def _optax_muon(cfg: OptimConfig, groups: dict, adam_weight_decay: float) -> optax.GradientTransformation:
    dims = {k: MuonDimensionNumbers(*g.matrix_axes) if g.group == "muon" else None for k, g in groups.items()}
    return optax.contrib.muon(
        _schedule(cfg.muon_lr),
        ns_coeffs=cfg.ns_coeffs,
        ns_steps=cfg.ns_steps,
        beta=cfg.muon_momentum,
        eps=cfg.adam_eps,
        weight_decay=cfg.muon_weight_decay,
        nesterov=cfg.nesterov,
        adam_b1=cfg.adam_b1,
        adam_b2=cfg.adam_b2,
        adam_weight_decay=adam_weight_decay,
        adam_learning_rate=_schedule(cfg.adam_lr),
        muon_weight_dimension_numbers=dims,
        consistent_rms=cfg.consistent_rms,
    )


def _assert_close(ours: jax.Array, ref: jax.Array, name: str) -> None:
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    ("nesterov", "consistent_rms"), [(False, None), (True, 0.2)], ids=["plain-width_scaling", "nesterov-rms"]
)
def test_matches_optax_contrib_muon(nesterov: bool, consistent_rms: float | None):
    cfg = dataclasses.replace(CFG, nesterov=nesterov, consistent_rms=consistent_rms)
    groups = param_groups(AXES)
    assert [k for k, g in groups.items() if g.group == "muon"] == ["experts", "layer_stack", "matrix"]
    ours = _train(build_optimizer(cfg, groups, TOTAL_STEPS))

    # optax decays every Adam leaf; ours only multi-axis ones, so vectors compare with decay off.
    ref = _train(_optax_muon(cfg, groups, adam_weight_decay=cfg.adam_weight_decay))
    ref_no_decay = _train(_optax_muon(cfg, groups, adam_weight_decay=0.0))
    for name in ("matrix", "layer_stack", "experts"):
        _assert_close(ours[name], ref[name], name)
    if nesterov:
        # optax.contrib.muon's Adam branch is Nesterov Adam when nesterov=True; ours stays plain AdamW.
        adamw = optax.adamw(
            _schedule(cfg.adam_lr),
            b1=cfg.adam_b1,
            b2=cfg.adam_b2,
            eps=cfg.adam_eps,
            weight_decay=cfg.adam_weight_decay,
            mask={k: g.group == "adamw" and g.decay for k, g in groups.items()},
        )
        ref = ref_no_decay = _train(adamw)
    _assert_close(ours["embedding"], ref["embedding"], "embedding")
    for name in ("norm", "bias"):
        _assert_close(ours[name], ref_no_decay[name], name)
    if not nesterov:  # the reference with decay differs from the one without: the decay acted
        assert not np.allclose(ref["embedding"], ref_no_decay["embedding"], rtol=0, atol=1e-6)


def _singular_values(x: jax.Array) -> np.ndarray:
    return np.linalg.svd(np.asarray(x), compute_uv=False)


@pytest.mark.parametrize("shape", [(64, 24), (24, 64)], ids=["tall", "wide"])
def test_newton_schulz_output_is_nearly_orthogonal(shape: tuple[int, int]):
    singular_values = _singular_values(newton_schulz(jax.random.normal(jax.random.key(1), shape)))
    assert singular_values.min() > 0.65 and singular_values.max() < 1.2, singular_values


def test_newton_schulz_lifts_a_spread_spectrum_into_the_band():
    # A square matrix with condition number 100: 5 quintic steps (slope 3.4 at zero) suffice.
    u, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(32, 32)))
    v, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(32, 32)))
    x = (u * np.logspace(-2, 0, 32)) @ v.T
    singular_values = _singular_values(newton_schulz(jnp.asarray(x, jnp.float32)))
    assert singular_values.min() > 0.65 and singular_values.max() < 1.2, singular_values


def test_batched_leaf_equals_per_matrix_newton_schulz():
    experts = jax.random.normal(jax.random.key(3), (2, 3, 40, 16))  # (layers, experts, in, out), tall
    batched = orthogonalize(experts, (2, 3))
    single = jax.jit(newton_schulz)
    for layer in range(2):
        for expert in range(3):
            _assert_close(batched[layer, expert], single(experts[layer, expert]), f"{layer},{expert}")


def test_matrix_axes_need_not_be_last():
    x = jax.random.normal(jax.random.key(4), (16, 3, 24))  # (in, layers, out)
    batched = orthogonalize(x, (0, 2))
    single = jax.jit(newton_schulz)
    for layer in range(3):
        _assert_close(batched[:, layer], single(x[:, layer]), str(layer))


def test_newton_schulz_runs_in_float32_for_bfloat16_input():
    x = jax.random.normal(jax.random.key(5), (2, 32, 48))
    out = newton_schulz(x.astype(jnp.bfloat16))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, newton_schulz(x.astype(jnp.bfloat16).astype(jnp.float32)), rtol=0, atol=0)


# The Gram formulation of Newton-Schulz (zaya_jax.ops.newton_schulz) against the standard one, on
# Muon leaves' matrices in their stored orientation (tall ones iterate on their short side): the
# `tiny` preset's k_proj, v/router down, experts wo and experts wi, and ZAYA1-8B's v_proj and
# k_proj, a few matrices each. Measured over Gaussian, low-rank + noise and ill-conditioned
# (singular values 1e-4..1) inputs, these and ZAYA1-8B's q, o and experts wi: relative Frobenius
# difference <= 2.3e-5, max |ΔX| <= 1.1e-5 (the Gram result is <= 2.1e-5 off the float64
# iteration, the standard one <= 1.0e-5). Without the restart (G recomputed from X after 3
# steps) the difference on these shapes' low-rank and ill-conditioned inputs is 8.9e-5..4.8e-4;
# a wrong sign or coefficient gives > 1e-2.
GRAM_REL_FRO_BOUND = 5e-5
GRAM_MAX_ABS_BOUND = 3e-5
GRAM_SHAPES = [(4, 128, 64), (4, 128, 32), (4, 256, 128), (4, 128, 512), (2, 2048, 128), (2, 2048, 256)]


def _matrices(kind: str, shape: tuple[int, int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    batch, m, n = shape[0], min(shape[1:]), max(shape[1:])
    if kind == "gaussian":
        x = rng.standard_normal((batch, m, n))
    elif kind == "low_rank":
        r = max(1, m // 8)
        signal = rng.standard_normal((batch, m, r)) @ rng.standard_normal((batch, r, n))
        x = signal + 0.01 * np.sqrt(r) * rng.standard_normal((batch, m, n))
    else:  # ill-conditioned: singular values log-spaced over 1e-4..1
        out = []
        for _ in range(batch):
            u, _ = np.linalg.qr(rng.standard_normal((m, m)))
            v, _ = np.linalg.qr(rng.standard_normal((n, m)))
            out.append((u * np.logspace(-4, 0, m)) @ v.T)
        x = np.stack(out)
    return np.swapaxes(x, -1, -2) if shape[1] > shape[2] else x


def _gram_vs_standard(
    x: jax.Array, restart: int | None = None, impl: str = "jax"
) -> tuple[float, float, np.ndarray, np.ndarray]:
    standard = np.asarray(
        jax.jit(lambda x: newton_schulz(x, impl=impl, formulation="standard"))(x), np.float64
    )
    if restart is None:
        gram = np.asarray(jax.jit(lambda x: newton_schulz(x, impl=impl, formulation="gram"))(x), np.float64)
    else:
        norm = jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-8
        fn = jax.jit(lambda x: newton_schulz_gram_reference(x, 5, *NS_COEFFS, restart=restart, norm=norm))
        gram = np.asarray(fn(x), np.float64)
    diff = gram - standard
    return float(np.linalg.norm(diff) / np.linalg.norm(standard)), float(np.abs(diff).max()), gram, standard


@pytest.mark.parametrize("impl", ["jax", "kernel"])  # XLA's loop; on this CPU the per-leaf call
@pytest.mark.parametrize("kind", ["gaussian", "low_rank", "ill_conditioned"])
@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gram_newton_schulz_matches_the_standard_iteration(kind: str, shape: tuple[int, int, int], impl: str):
    x = jnp.asarray(_matrices(kind, shape, seed=shape[1] + shape[2]), jnp.float32)
    rel_fro, max_abs, gram, standard = _gram_vs_standard(x, impl=impl)
    assert rel_fro < GRAM_REL_FRO_BOUND and max_abs < GRAM_MAX_ABS_BOUND, (rel_fro, max_abs)
    # Same singular-value band: [0.68, 1.14] for well-spread spectra, the same small ones lifted.
    np.testing.assert_allclose(_singular_values(gram), _singular_values(standard), rtol=0, atol=1e-4)


def test_gram_newton_schulz_needs_its_restart():
    # The bound is tight enough to see the restart: one 5-step Gram segment drifts past it.
    x = jnp.asarray(_matrices("ill_conditioned", (4, 128, 512), seed=0), jnp.float32)
    assert _gram_vs_standard(x, restart=3)[0] < GRAM_REL_FRO_BOUND
    assert _gram_vs_standard(x, restart=5)[0] > GRAM_REL_FRO_BOUND


def test_auto_formulation_is_gram_where_it_saves_flops_and_memory():
    for m, n in [(32, 32), (128, 128), (128, 192), (128, 256), (128, 511), (128, 512), (64, 4096)]:
        gram = resolve_formulation("auto", m, n) == "gram"
        assert gram == (n >= 4 * m), (m, n)
        assert gram_flops(m, n, 5) < standard_flops(m, n, 5) or not gram, (m, n)
    # Not where float32 matmuls are TF32 (GPUs' default), where the Gram form drifts to ~1% off.
    assert resolve_formulation("auto", 64, 4096, full_precision=False) == "standard"
    assert resolve_formulation("gram", 64, 128, full_precision=False) == "gram"
    assert full_float32_matmuls()  # CPU
    # The FLOP crossover is n = 5m/3 (213.3 for m = 128).
    assert gram_flops(128, 214, 5) < standard_flops(128, 214, 5)
    assert gram_flops(128, 213, 5) > standard_flops(128, 213, 5)
    # Leaf by leaf in the JAX loop: wide with aspect >= 4 is Gram (bit for bit); tall ones (see
    # newton_schulz) and the rest standard. Asked for, tall ones run Gram too.
    for shape, auto in [((3, 24, 96), "gram"), ((3, 96, 24), "standard"), ((3, 32, 64), "standard")]:
        x = jax.random.normal(jax.random.key(6), shape)
        np.testing.assert_array_equal(
            orthogonalize(x, (1, 2), impl="jax"), newton_schulz(x, impl="jax", formulation=auto)
        )
    tall = jax.random.normal(jax.random.key(7), (3, 96, 24))
    assert not np.array_equal(
        newton_schulz(tall, impl="jax", formulation="gram"), newton_schulz(tall, impl="jax")
    )
    with pytest.raises(ValueError, match="formulation"):
        newton_schulz(x, formulation="fast")
    with pytest.raises(ValueError, match="impl"):
        newton_schulz(x, impl="fast")


def test_optim_ns_formulation_reaches_the_muon_leaves():
    # Every leaf here has aspect <= 2.5: the JAX loop's auto is standard; the CPU kernel's is the
    # cheaper one, gram for the experts' 16 x 40. "gram" changes the results, slightly.
    groups = param_groups(AXES)
    kernel = newton_schulz_cpu.available()
    impl = "kernel" if kernel else "jax"  # the kernel plan's auto on this CPU
    trained = {
        f: _train(
            build_optimizer(
                dataclasses.replace(CFG, ns_formulation=f), groups, TOTAL_STEPS, newton_schulz=impl
            )
        )
        for f in ("auto", "standard", "gram")
    }
    auto = {"matrix": "standard", "layer_stack": "standard", "experts": "gram" if kernel else "standard"}
    for name in ("matrix", "layer_stack", "experts"):
        np.testing.assert_array_equal(trained["auto"][name], trained[auto[name]][name])
        assert not np.array_equal(trained["gram"][name], trained["standard"][name])
    for name in ("matrix", "layer_stack", "experts"):
        _assert_close(trained["gram"][name], trained["standard"][name], name)
