"""The rollout engine (zaya_jax.engine): greedy tokens, log-probabilities and routes equal the static
sampler's (a sliding window, prompts longer than a prefill chunk, fewer slots than prompts); a row
continuously batched equals the same request run alone, seeded sampling included, whatever the arrival
order; stop ids, stop strings and token limits end rows; programs compile once per shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.random_model import tiny_config, varied_variables
from zaya_jax.engine import Engine, Request, filter_logits, filter_rows
from zaya_jax.engine import programs as engine_programs
from zaya_jax.generate import generate, static_generate


def _prompts(cfg, count: int, longest: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, cfg.vocab_size, rng.integers(1, longest + 1)).tolist() for _ in range(count)]


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(layer_types=("hybrid", "hybrid_sliding"), sliding_window=3)],
    ids=["full", "sliding"],
)
def test_greedy_tokens_logprobs_and_routes_equal_the_static_sampler(overrides):
    cfg = tiny_config(**overrides)
    variables = varied_variables(cfg)
    prompts = _prompts(cfg, 9, 21)  # up to 21 tokens: three prefill chunks of 8
    static = static_generate(cfg, variables, prompts, max_new_tokens=12, stop_tokens=[], return_routes=True)
    values, counts = np.unique(static.tokens[:, 2:], return_counts=True)
    stop = int(values[counts.argmax()])  # a token many rows generate: they stop at different steps
    static = static_generate(
        cfg, variables, prompts, max_new_tokens=12, stop_tokens=[stop], return_routes=True
    )
    assert len(set(static.lengths.tolist())) > 1

    engine = Engine(cfg, variables, slots=3, prefill_chunk=8, token_budget=16, return_routes=True)
    results = engine.run([Request(p, 12, stop_tokens=(stop,)) for p in prompts])
    for row, result in enumerate(results):
        assert result.tokens.tolist() == static.rows()[row]
        assert result.stopped == bool(static.stopped[row])
        np.testing.assert_allclose(result.logprobs, static.logprobs[row, : len(result.tokens)], atol=1e-5)
        np.testing.assert_array_equal(result.routes, static.row_routes(row))
    assert engine.stats.prefill_calls >= 9 and engine.stats.new_tokens == int(static.lengths.sum())
    assert engine.stats.prompt_tokens == sum(map(len, prompts))

    # generate() runs the engine and returns the static sampler's Generation, field for field
    through = generate(
        cfg,
        variables,
        prompts,
        max_new_tokens=12,
        stop_tokens=[stop],
        return_routes=True,
        slots=3,
        prefill_chunk=8,
    )
    for name in ("tokens", "lengths", "stopped", "prompt_lengths", "prompt_routes", "routes"):
        np.testing.assert_array_equal(getattr(through, name), getattr(static, name), err_msg=name)
    np.testing.assert_allclose(through.logprobs, static.logprobs, atol=1e-5)


def test_a_row_batched_continuously_equals_the_same_request_alone_in_any_arrival_order():
    cfg = tiny_config()
    variables = varied_variables(cfg)
    prompts = _prompts(cfg, 7, 12, seed=1)
    requests = [
        Request(p, max_new_tokens=3 + 2 * i, temperature=1.5, top_k=(0, 5)[i % 2], top_p=(1.0, 0.9)[i % 3 == 0],
                seed=11, stream=i)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    alone = [Engine(cfg, variables, slots=1, return_routes=True).run([r])[0] for r in requests]
    order = [4, 0, 6, 2, 5, 1, 3]
    batched = Engine(cfg, variables, slots=3, prefill_chunk=4, return_routes=True).run(
        [requests[i] for i in order]
    )
    for result, i in zip(batched, order, strict=True):
        assert result.tokens.tolist() == alone[i].tokens.tolist()
        np.testing.assert_allclose(result.logprobs, alone[i].logprobs, atol=1e-5)
        np.testing.assert_array_equal(result.routes, alone[i].routes)
        assert len(result.tokens) == requests[i].max_new_tokens  # no stop ids: each row's own limit
    other_seed = Engine(cfg, variables, slots=3).run([Request(p, 8, 1.5, seed=12) for p in prompts])
    same_seed = Engine(cfg, variables, slots=3).run([Request(p, 8, 1.5, seed=11) for p in prompts])
    assert any(a.tokens.tolist() != b.tokens.tolist() for a, b in zip(other_seed, same_seed, strict=True))


def test_slots_are_reused_without_recompiling_and_calls_of_one_shape_share_programs():
    cfg = tiny_config()
    variables = varied_variables(cfg)
    engine = Engine(cfg, variables, slots=2, prefill_chunk=8)
    engine.run([Request(p, 6) for p in _prompts(cfg, 6, 10, seed=2)])
    shape = engine_programs.Shape(2, 64, 64, 4, False)
    decode = engine_programs.decode_program(engine.cfg, shape)
    assert engine.stats.decode_calls >= 3 and decode._cache_size() == 1
    engine.run([Request(p, 9) for p in _prompts(cfg, 5, 14, seed=3)])
    assert decode._cache_size() == 1  # another call of the same shape: nothing compiled


def test_a_reused_slot_forgets_the_previous_rows_sliding_window():
    """A sliding layer's ring (window 3) still holds the previous row's last positions (1-3) when
    the next prompt enters the slot; the new row must not see them at its own positions 1-3."""
    cfg = tiny_config(layer_types=("hybrid_sliding", "hybrid"), sliding_window=3)
    variables = varied_variables(cfg)
    short, long = Request([5, 6], 2), Request(_prompts(cfg, 1, 10, seed=4)[0] + [7] * 10, 4)
    first, reused = Engine(cfg, variables, slots=1, prefill_chunk=8).run([short, long])
    assert first.tokens.size == 2
    alone = Engine(cfg, variables, slots=1, prefill_chunk=8).run([long])[0]
    assert reused.tokens.tolist() == alone.tokens.tolist()
    np.testing.assert_allclose(reused.logprobs, alone.logprobs, atol=1e-6)


def test_stop_strings_end_a_row_at_the_token_that_completes_them():
    cfg = tiny_config()
    variables = varied_variables(cfg)
    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # noqa: E731
    prompt = _prompts(cfg, 1, 6, seed=4)[0]
    free = Engine(cfg, variables, slots=2).run([Request(prompt, 40)])[0]
    text = decode(free.tokens.tolist())
    target = text[22:24]  # a string first completed deep in the row (past one 16-step decode call)
    expected = min(k for k in range(1, 41) if target in decode(free.tokens[:k].tolist()))
    engine = Engine(cfg, variables, slots=2, decode=decode)
    stopped, plain = engine.run([Request(prompt, 40, stop_strings=(target,)), Request(prompt, 40)])
    assert stopped.stopped and stopped.tokens.tolist() == free.tokens[:expected].tolist()
    assert not plain.stopped and plain.tokens.tolist() == free.tokens.tolist()
    with pytest.raises(ValueError, match="stop_strings need the engine's decode"):
        Engine(cfg, variables).run([Request(prompt, 4, stop_strings=("x",))])


def test_bad_requests_are_refused_naming_the_request_and_the_fix():
    cfg = tiny_config()
    engine = Engine(cfg, varied_variables(cfg), capacity=20)
    cases = [
        (Request([]), "request 0: the prompt is empty"),
        (Request([cfg.vocab_size]), r"prompt ids must be integers in \[0, 61\)"),
        (Request([4], max_new_tokens=0), "max_new_tokens must be >= 1"),
        (Request([4], temperature=-1.0), "temperature must be >= 0"),
        (Request([4], top_p=0.0), r"top_p must be in \(0, 1\]"),
        (Request([4], max_new_tokens=cfg.max_position_embeddings), "max_position_embeddings"),
        (Request([4] * 12, max_new_tokens=10), "more than the engine's capacity=20"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.run([Request([5]), request] if "request 0" not in message else [request])
    with pytest.raises(ValueError, match="token_budget=4 must hold one prefill_chunk"):
        Engine(cfg, {}, prefill_chunk=8, token_budget=4)


def test_per_row_filters_keep_what_the_batch_filter_keeps_for_each_row():
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((4, 50)), jnp.float32)
    settings = [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.6), (2.0, 9, 0.8)]
    rows = filter_rows(logits, *(jnp.asarray(column) for column in zip(*settings, strict=True)))
    for row, (temperature, top_k, top_p) in enumerate(settings):
        alone = filter_logits(logits[row : row + 1], temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(rows[row]), np.isfinite(alone[0]))
        finite = np.isfinite(alone[0])
        np.testing.assert_allclose(np.asarray(rows[row])[finite], np.asarray(alone[0])[finite], rtol=1e-6)


def test_a_sampled_tokens_log_probability_is_under_the_distribution_it_was_drawn_from():
    """A sampling row's log-probability is the token's under its temperature, top-k, top-p and the
    vocabulary limit (what GRPO's trainer computes, rl.temperature/top_k/top_p); a greedy row's is
    the model's own."""
    from zaya_jax.engine.sampling import choose

    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.standard_normal((3, 50)) * 2, jnp.float32)
    rows = {
        "temperature": jnp.asarray([0.7, 1.3, 0.0]),
        "top_k": jnp.asarray([0, 8, 0]),
        "top_p": jnp.asarray([0.9, 1.0, 1.0]),
        "seed": jnp.asarray([1, 2, 3]),
        "stream": jnp.asarray([0, 1, 2]),
    }
    token, logprob = jax.jit(choose)(logits, rows, jnp.zeros(3, jnp.int32), jnp.int32(45))
    assert int(token.max()) < 45  # never past the vocabulary limit
    for row in range(2):
        limited = jnp.where(jnp.arange(50) < 45, logits[row], -jnp.inf)[None]
        temperature, top_k, top_p = (float(rows[k][row]) for k in ("temperature", "top_k", "top_p"))
        drawn_from = jax.nn.log_softmax(filter_logits(limited, temperature, int(top_k), top_p))[0]
        assert np.isclose(float(logprob[row]), float(drawn_from[token[row]]), atol=1e-6)
        model_own = float(jax.nn.log_softmax(logits[row])[token[row]])
        assert abs(float(logprob[row]) - model_own) > 0.05  # not the temperature-1 value
    assert np.isclose(float(logprob[2]), float(jax.nn.log_softmax(logits[2])[token[2]]), atol=1e-6)
    assert int(token[2]) == int(jnp.argmax(logits[2][:45]))


@pytest.mark.parametrize("slots", [16, 5], ids=["whole-groups", "groups-split-across-admissions"])
def test_a_groups_prompt_read_once_and_forked_gives_what_each_row_reading_it_alone_gives(slots):
    """share_prompts: the completions of one prompt read it once (the leader), the others get a copy
    of its cache before its last token; tokens, log-probabilities and routes equal those of every
    row reading its prompt itself, sampling included (each row its own stream), prompts longer than
    a prefill chunk and slots too few for whole groups (a late follower reads its prompt alone)."""
    cfg = tiny_config(layer_types=("hybrid", "hybrid_sliding"), sliding_window=3)
    variables = varied_variables(cfg)
    prompts = [*_prompts(cfg, 3, 19, seed=4), [7]]  # a one-token prompt has nothing to share
    requests = [
        Request(p, max_new_tokens=6, temperature=1.2, top_k=8, seed=3, stream=g * 4 + k)
        for g, p in enumerate(prompts)
        for k in range(4)
    ]
    runs = {}
    for share in (False, True):
        engine = Engine(cfg, variables, slots=slots, prefill_chunk=8, return_routes=True, share_prompts=share)
        runs[share] = (engine.run(requests), engine.stats)
    (alone, plain), (forked, shared) = runs[False], runs[True]
    for a, b in zip(alone, forked, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
        np.testing.assert_array_equal(b.routes, a.routes)
    assert len({tuple(r.tokens.tolist()) for r in forked[:4]}) > 1  # a group's rows differ: own streams
    assert plain.shared_prompt_tokens == 0 and plain.prompt_tokens == sum(len(r.prompt) for r in requests)
    assert shared.shared_prompt_tokens > 0
    assert shared.prompt_tokens + shared.shared_prompt_tokens == plain.prompt_tokens
    if slots == 16:  # every follower forked: each prompt read once, plus each follower's last token
        assert shared.prompt_tokens == sum(len(p) + 3 if len(p) > 1 else 4 * len(p) for p in prompts)
