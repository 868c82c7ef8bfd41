"""Router replay: the sampler's captured routes, forced in a training forward, reproduce the
sampler's log-probabilities; after an optimizer step the forward without replay selects other
classes for some tokens while the forward with replay selects exactly the captured ones, and the
router's gradient still flows through the replayed choice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tests.random_model import random_variables, tiny_config
from zaya_jax.generate import generate
from zaya_jax.model import Zaya

PROMPTS = [[5, 9, 14, 3, 22], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [30, 31]]


def _training_rows(prompts, gen, pad_id):
    """Right-padded (inputs, targets, mask, completion mask, routes) of prompt + completion."""
    seqs = [list(p) + row for p, row in zip(prompts, gen.rows(), strict=True)]
    width = max(map(len, seqs)) - 1
    inputs = np.full((len(seqs), width), pad_id, np.int32)
    targets = np.full_like(inputs, pad_id)
    mask, completion = np.zeros_like(inputs), np.zeros(inputs.shape, np.float32)
    routes = np.full((*inputs.shape, gen.prompt_routes.shape[-1]), -1, np.int32)
    for i, (prompt, seq) in enumerate(zip(prompts, seqs, strict=True)):
        n = len(seq) - 1
        inputs[i, :n], targets[i, :n], mask[i, :n] = seq[:-1], seq[1:], 1
        completion[i, len(prompt) - 1 : n] = 1
        routes[i, :n] = gen.row_routes(i)[:-1]  # the last generated token is never read
    return inputs, targets, mask, completion, routes


def _forward(cfg, variables, inputs, mask, routes=None):
    (logits, _), state = Zaya(cfg).apply(
        variables, jnp.asarray(inputs), token_mask=jnp.asarray(mask), routes=routes, mutable=["intermediates"]
    )
    choice = np.moveaxis(np.asarray(state["intermediates"]["layers"]["router_choice"][0]), 0, -1)
    return logits, choice


def _target_logprobs(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0])


def test_replayed_routes_reproduce_the_sampler_and_hold_after_an_update():
    cfg = tiny_config()
    variables = random_variables(cfg)
    gen = generate(
        cfg, variables, PROMPTS, max_new_tokens=8, temperature=1.0, seed=3, stop_tokens=[], return_routes=True
    )
    assert gen.lengths.tolist() == [8] * 4
    assert gen.prompt_routes.shape == (4, 7, cfg.num_layers) and gen.routes.shape == (4, 8, cfg.num_layers)
    assert (gen.prompt_routes[1, :4] == -1).all() and (gen.routes[:, -1] == -1).all()
    assert gen.routes[:, :-1].min() >= 0 and gen.routes.max() <= cfg.num_experts
    inputs, targets, mask, completion, routes = _training_rows(PROMPTS, gen, cfg.pad_token_id)
    real = mask.astype(bool)

    logits, choice = _forward(cfg, variables, inputs, mask, jnp.asarray(routes))
    sampled = _target_logprobs(logits, targets)
    for i, n in enumerate(gen.lengths):
        np.testing.assert_allclose(sampled[i][completion[i] > 0], gen.logprobs[i, :n], atol=1e-5, rtol=0)
    assert (choice[real] == routes[real]).all()

    # "-1" routes normally: the choices and logits of no replay at all.
    free, free_choice = _forward(cfg, variables, inputs, mask, jnp.full_like(jnp.asarray(routes), -1))
    plain, plain_choice = _forward(cfg, variables, inputs, mask)
    np.testing.assert_array_equal(free_choice, plain_choice)
    np.testing.assert_allclose(np.asarray(free), np.asarray(plain), atol=2e-6, rtol=0)

    # One Adam step on the completion tokens' loss, routed as the sampler routed.
    def loss(params, replay):
        variables_ = {**variables, "params": params}
        out, _ = Zaya(cfg).apply(variables_, jnp.asarray(inputs), token_mask=mask, routes=replay)
        logp = jax.nn.log_softmax(out.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
        return -(picked * completion).sum() / completion.sum()

    grads = jax.grad(loss)(variables["params"], jnp.asarray(routes))
    router_grad = grads["layers"]["router"]["out"]["kernel"]
    assert float(jnp.abs(router_grad).max()) > 0  # the router learns through the replayed choice
    tx = optax.adam(0.05)
    updates, _ = tx.update(grads, tx.init(variables["params"]), variables["params"])
    stepped = {**variables, "params": optax.apply_updates(variables["params"], updates)}

    _, replayed = _forward(cfg, stepped, inputs, mask, jnp.asarray(routes))
    _, unreplayed = _forward(cfg, stepped, inputs, mask)
    flips = int((unreplayed[real] != routes[real]).sum())
    assert (replayed[real] == routes[real]).all()  # 0 flips with replay
    assert flips > 0, "the update changed no routing decision: the test lost its power"
