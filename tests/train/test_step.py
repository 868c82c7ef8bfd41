"""The pure train step: deterministic, exact gradient accumulation, token-weighted masked loss,
z-loss, the balancing controller outside the gradient, and a bounded number of compilations."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures import synthetic_batch, tiny_train_config
from tests.random_model import TINY
from zaya_jax.config import Config
from zaya_jax.loss import loss_and_stats, token_losses
from zaya_jax.model import BALANCING, Zaya, init_variables
from zaya_jax.objectives.lm import next_token
from zaya_jax.optim import build_optimizer, model_param_groups, set_lr_scale
from zaya_jax.programs import init_train_state, make_train_step


@functools.lru_cache(maxsize=8)
def _compiled(cfg: Config):
    """One jitted step per config (the seed does not matter): compiling dominates these tests."""
    tx = build_optimizer(cfg.optim, model_param_groups(cfg.model, cfg.optim.router_group), cfg.train.steps)
    return tx, jax.jit(make_train_step(cfg, tx, set_lr_scale, objective=next_token(cfg)), donate_argnums=0)


def _setup(cfg: Config):
    tx, step = _compiled(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=0)))
    return init_train_state(init_variables(cfg.model, cfg.train.seed), tx), step


def _losses(cfg: Config, steps: int = 3) -> list[float]:
    state, step = _setup(cfg)
    out = []
    for i in range(steps):
        state, metrics = step(
            state, synthetic_batch(i, cfg.train.batch_size, cfg.train.seq_len), jnp.float32(1.0)
        )
        out.append(float(metrics["loss"]))
    return out


def test_same_config_and_data_give_bit_identical_losses():
    cfg = tiny_train_config(batch_size=4)
    first, second = _losses(cfg), _losses(cfg)
    assert first == second
    assert first[1:] != _losses(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=1)))[1:]


def test_gradient_accumulation_equals_one_big_batch():
    one = tiny_train_config(batch_size=4, micro_batches=1)
    four = tiny_train_config(batch_size=4, micro_batches=4)
    state_one, step_one = _setup(one)
    state_four, step_four = _setup(four)
    batch = synthetic_batch(0, 4, 16)
    state_one, m_one = step_one(state_one, batch, jnp.float32(1.0))
    state_four, m_four = step_four(state_four, batch, jnp.float32(1.0))
    assert float(m_one["loss"]) == pytest.approx(float(m_four["loss"]), rel=1e-6)
    for a, b in zip(jax.tree.leaves(state_one.params), jax.tree.leaves(state_four.params), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_loss_is_the_token_weighted_mean_over_unmasked_targets():
    variables = init_variables(TINY, 0)
    batch = synthetic_batch(3, 2, 16)
    summed, stats = loss_and_stats(Zaya(TINY), variables["params"], variables[BALANCING], batch, z_loss=0.0)
    logits, _ = Zaya(TINY).apply(
        variables, batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"]
    )
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), np.asarray(batch["targets"])[..., None], -1)[..., 0]
    mask = np.asarray(batch["loss_mask"])
    assert float(stats["tokens"]) == mask.sum() < mask.size  # padding is excluded
    assert float(summed) == pytest.approx((nll * mask).sum(), rel=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_loss_gradients_equal_the_full_logits_gradients(tied):
    """The step's loss applies the LM head in chunks of 5 positions (16 per row: chunks do not
    divide it); its parameter gradients, z-loss included, equal those through the model's logits."""
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied, lm_head_bias=not tied)
    variables = init_variables(cfg, 0)
    batch = synthetic_batch(4, 2, 16, cfg.vocab_size)
    model = Zaya(cfg)

    def chunked(params):
        return loss_and_stats(model, params, variables[BALANCING], batch, z_loss=1e-2, loss_chunk=5)[0]

    def full(params):
        logits, _ = model.apply(
            {"params": params, BALANCING: variables[BALANCING]},
            batch["inputs"],
            token_mask=batch["segment_ids"] > 0,
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
        )
        ce, log_z = token_losses(logits, batch["targets"])
        return jnp.sum((ce + 1e-2 * jnp.square(log_z)) * batch["loss_mask"])

    assert float(chunked(variables["params"])) == pytest.approx(float(full(variables["params"])), rel=1e-6)
    got, want = jax.jit(jax.grad(chunked))(variables["params"]), jax.jit(jax.grad(full))(variables["params"])
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = functools.reduce(lambda tree, key: tree[key.key], path, want)
        scale = max(float(np.max(np.abs(b))), 1e-8)
        assert float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) <= 1e-5 * scale, jax.tree_util.keystr(
            path
        )


def test_z_loss_adds_the_mean_squared_log_partition():
    logits = jnp.asarray([[[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]]])
    targets = jnp.asarray([[2, 0]])
    ce, log_z = token_losses(logits, targets)
    expected_log_z = np.log(np.exp(np.asarray(logits)).sum(-1))
    np.testing.assert_allclose(log_z, expected_log_z, rtol=1e-6)
    np.testing.assert_allclose(ce, expected_log_z - np.array([[3.0, 0.0]]), rtol=1e-6)
    cfg = tiny_train_config(batch_size=2, z_loss=1e-2)
    state, step = _setup(cfg)
    _, metrics = step(state, synthetic_batch(0, 2, 16), jnp.float32(1.0))
    assert float(metrics["log_z_squared"]) > 0


@pytest.mark.parametrize("enabled", [True, False])
def test_balancing_controller_moves_the_biases_only_when_enabled(enabled):
    cfg = tiny_train_config(batch_size=4)
    cfg = dataclasses.replace(cfg, balancing=dataclasses.replace(cfg.balancing, enabled=enabled))
    state, step = _setup(cfg)
    before = np.asarray(state.balancing["layers"]["router"]["biases"])
    for i in range(2):
        state, _ = step(state, synthetic_batch(i, 4, 16), jnp.float32(1.0))
    after = np.asarray(state.balancing["layers"]["router"]["biases"])
    assert (np.abs(after - before).max() > 0) == enabled


def test_repeated_batch_is_memorised():
    cfg = tiny_train_config(batch_size=4)
    state, step = _setup(cfg)
    batch = synthetic_batch(0, 4, 16)
    losses = []
    for _ in range(40):
        state, metrics = step(state, batch, jnp.float32(1.0))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]


def test_step_compiles_once_per_batch_shape():
    cfg = tiny_train_config(batch_size=4)
    tx, _ = _compiled(cfg)
    state = init_train_state(init_variables(cfg.model, 0), tx)
    traces = []
    inner = make_train_step(cfg, tx, set_lr_scale, objective=next_token(cfg))

    def counted(state, batch, lr_scale):
        traces.append(batch["inputs"].shape)
        return inner(state, batch, lr_scale)

    step = jax.jit(counted, donate_argnums=0)
    for i, (batch_size, lr_scale) in enumerate([(2, 0.5), (2, 0.7), (4, 1.0), (4, 1.0), (2, 0.6)]):
        state, _ = step(state, synthetic_batch(i, batch_size, 16), jnp.float32(lr_scale))
    assert traces == [(2, 16), (4, 16)]  # learning-rate scale changes do not recompile


def test_load_ratio_is_infinite_not_a_sentinel_when_an_expert_gets_no_token():
    """metrics.jsonl writes it as null; it used to read 1e9 (max / max(min, 1e-9))."""
    cfg = tiny_train_config(batch_size=2)
    state, step = _setup(cfg)
    biases = state.balancing["layers"]["router"]["biases"]
    forced = state.replace(balancing={"layers": {"router": {"biases": biases.at[:, 0].set(50.0)}}})
    _, metrics = step(forced, synthetic_batch(0, 2, 16), jnp.float32(1.0))
    assert float(metrics["max_min_load_ratio"]) == np.inf  # every token chose expert 0
    _, metrics = step(_setup(cfg)[0], synthetic_batch(0, 2, 16), jnp.float32(1.0))
    assert 1.0 <= float(metrics["max_min_load_ratio"]) < 1e6
