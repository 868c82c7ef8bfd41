"""Decoding with the CCA cache: chunked prefill and token-by-token decode equal the full forward,
greedy generation equals Hugging Face ``generate`` (left padding and a stop token included), the
sampling filters and streams (a share of the rows sampled apart draws what it draws in the whole), ``lm.generate`` with text and ``zaya generate``."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zaya_jax
from tests.random_model import random_variables, tiny_config
from zaya_jax.cli import main
from zaya_jax.generate import filter_logits, generate, left_pad
from zaya_jax.model import Zaya, init_cache


@pytest.mark.parametrize(
    "overrides",
    [
        dict(layer_types=("hybrid", "hybrid_sliding"), sliding_window=3),
        dict(cca_time0=3, cca_time1=3, attention_bias=True),
        dict(cca_time0=1, cca_time1=1, num_kv_heads=1),
    ],
    ids=["sliding", "wide-conv+bias", "no-conv-context"],
)
def test_chunked_prefill_and_token_by_token_decode_equal_the_full_forward(overrides):
    cfg = tiny_config(**overrides)
    variables = random_variables(cfg)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 11)), jnp.int32)
    full, _ = Zaya(cfg).apply(variables, ids)

    step = jax.jit(lambda v, t, c: Zaya(cfg).apply(v, t, cache=c))
    cache = init_cache(cfg, batch=2, length=16)
    pieces = []
    for start, stop in [(0, 4), (4, 5), (5, 8), *((t, t + 1) for t in range(8, 11))]:
        logits, aux = step(variables, ids[:, start:stop], cache)
        cache = aux["cache"]
        pieces.append(logits)
    decoded = jnp.concatenate(pieces, axis=1)
    assert int(cache["index"]) == 11
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), atol=2e-5)


@pytest.mark.parametrize("types", [("hybrid", "hybrid_sliding"), ("hybrid_sliding", "hybrid_sliding")])
def test_a_slot_cache_reads_each_row_at_its_own_offset_like_the_full_forward(types):
    """init_cache(per_row=True): rows written at their own positions, real tokens first in each
    chunk (the rest padding), equal the full forward; a row given no tokens keeps its state. The
    sliding layers keep rings of their window's 3 positions, read in chunks up to 7 wide."""
    cfg = tiny_config(layer_types=types, sliding_window=3, cca_time0=3)
    variables = random_variables(cfg)
    sliding = types.count("hybrid_sliding")
    shapes = jax.eval_shape(lambda: init_cache(cfg, batch=2, length=16, per_row=True))
    assert shapes["window_keys"].shape == (sliding, 2, cfg.num_kv_heads, 3, cfg.head_dim)
    assert shapes["keys"].shape[0] == cfg.num_layers - sliding and shapes["window_slots"].shape == (2, 3)
    ids = np.random.default_rng(2).integers(3, cfg.vocab_size, (2, 11)).astype(np.int32)
    full, _ = Zaya(cfg).apply(variables, jnp.asarray(ids))
    step = jax.jit(lambda v, t, m, c: Zaya(cfg).apply(v, t, token_mask=m, cache=c))
    cache, pieces = init_cache(cfg, batch=2, length=16, per_row=True), [[], []]
    for chunks in [((0, 4), (0, 0)), ((4, 5), (0, 2)), ((5, 11), (2, 9)), ((11, 11), (9, 11))]:
        tokens, mask = np.zeros((2, 7), np.int32), np.zeros((2, 7), np.int32)
        for row, (start, stop) in enumerate(chunks):
            tokens[row, : stop - start], mask[row, : stop - start] = ids[row, start:stop], 1
        logits, aux = step(variables, jnp.asarray(tokens), jnp.asarray(mask), cache)
        cache = aux["cache"]
        for row, (start, stop) in enumerate(chunks):
            pieces[row].append(np.asarray(logits[row, : stop - start]))
    assert cache["index"].tolist() == [11, 11]
    for row in range(2):
        np.testing.assert_allclose(np.concatenate(pieces[row]), np.asarray(full[row]), atol=2e-5)


def test_a_left_padded_row_decodes_like_the_same_prompt_alone():
    cfg = tiny_config()
    variables = random_variables(cfg)
    prompt = [5, 9, 14, 3, 22]
    ids, mask = left_pad([prompt, [7, 8, 9, 10, 11, 12, 13, 14]], cfg.pad_token_id)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    cache = init_cache(cfg, batch=2, length=ids.shape[1] + 1)
    padded, aux = Zaya(cfg).apply(variables, ids, token_mask=mask, positions=positions, cache=cache)
    next_padded, _ = Zaya(cfg).apply(
        variables, jnp.asarray([[40], [41]]), positions=positions[:, -1:] + 1, cache=aux["cache"]
    )
    alone, _ = Zaya(cfg).apply(variables, jnp.asarray([[*prompt, 40]]))
    np.testing.assert_allclose(np.asarray(padded[0, -5:]), np.asarray(alone[0, :5]), atol=2e-5)
    np.testing.assert_allclose(np.asarray(next_padded[0, 0]), np.asarray(alone[0, 5]), atol=2e-5)


def _hf_pair(**overrides):
    """A randomised HF model and the same model in zaya-jax. The residual and input biases are
    zeroed: with them every random prompt greedily repeats one token, which would test nothing."""
    from tests.hf_reference import make_hf_model, state_dict_numpy, torch
    from zaya_jax.interop.hf import hf_config_to_model, hf_to_variables

    hf = make_hf_model(0, tie_word_embeddings=False, **overrides)
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            if name.endswith("_bias") and "balancing" not in name:
                tensor.zero_()
    cfg = hf_config_to_model(hf.config.to_dict())
    return hf, cfg, jax.tree.map(jnp.asarray, hf_to_variables(state_dict_numpy(hf), cfg))


YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4}
ROPES = {
    "default": None,  # TINY_HF's
    # YaRN from an original length of 4: every prompt and reply runs past it
    "yarn": {
        "hybrid": {"rope_theta": 1e4, "partial_rotary_factor": 0.5, **YARN},
        "hybrid_sliding": {"rope_theta": 500.0, "partial_rotary_factor": 0.5, **YARN},
    },
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_greedy_generation_equals_hf_generate_with_left_padding_and_a_stop_token(rope):
    from tests.hf_reference import torch

    hf, cfg, variables = _hf_pair(**({"rope_parameters": ROPES[rope]} if ROPES[rope] else {}))
    assert (cfg.rope_scaling is not None) == (rope == "yarn")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (7, 3, 5)]
    new = 12
    ours = generate(cfg, variables, prompts, max_new_tokens=new, stop_tokens=[])
    # The generated tokens are not one token repeated: the test would be weak otherwise.
    assert all(len(set(row)) >= 2 for row in ours.tokens.tolist())

    ids, mask = left_pad(prompts, cfg.pad_token_id)
    stop = int(ours.tokens[0, 5])  # a token row 0 emits mid-way: HF must stop there too
    with torch.no_grad():
        reference = hf.generate(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=cfg.pad_token_id,
        )[:, ids.shape[1] :].numpy()
    stopped = generate(cfg, variables, prompts, max_new_tokens=new, stop_tokens=[stop])
    width = reference.shape[1]  # HF stops early once every row has stopped
    np.testing.assert_array_equal(stopped.tokens[:, :width], reference)
    assert np.all(stopped.tokens[:, width:] == cfg.pad_token_id)
    first = ours.tokens[0].tolist().index(stop)
    assert stopped.lengths[0] == first + 1 and stopped.stopped[0]
    assert stopped.rows()[0] == ours.tokens[0, : first + 1].tolist()


def test_sampling_filters_keep_exactly_the_top_k_and_the_nucleus():
    logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    kept = lambda out: set(np.flatnonzero(np.isfinite(np.asarray(out[0]))).tolist())  # noqa: E731
    assert kept(filter_logits(logits, 1.0, 2, 1.0)) == {1, 3}
    assert kept(filter_logits(logits, 1.0, 0, 0.65)) == {1, 3}  # 0.4 + 0.3 reaches 0.65
    assert kept(filter_logits(logits, 1.0, 0, 0.75)) == {1, 3, 4}
    assert kept(filter_logits(logits, 1.0, 0, 1e-6)) == {1}  # the most likely token always survives
    assert kept(filter_logits(logits, 1.0, 0, 1.0)) == {0, 1, 2, 3, 4}
    np.testing.assert_allclose(
        np.asarray(filter_logits(logits, 2.0, 0, 1.0)), np.asarray(logits) / 2, rtol=1e-6
    )


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    cfg = tiny_config()
    variables = random_variables(cfg)
    prompts = [[5, 9, 14], [7, 8]]
    greedy = generate(cfg, variables, prompts, max_new_tokens=6, stop_tokens=[])
    top1 = generate(
        cfg, variables, prompts, max_new_tokens=6, temperature=0.7, top_k=1, stop_tokens=[], seed=3
    )
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)

    def sample(seed):
        return generate(cfg, variables, prompts, max_new_tokens=6, temperature=5.0, stop_tokens=[], seed=seed)

    np.testing.assert_array_equal(sample(1).tokens, sample(1).tokens)
    assert not np.array_equal(sample(1).tokens, sample(2).tokens)
    # a share of the rows sampled apart (another process's, in GRPO) names its first row's stream
    rows = [[5, 9, 14], [7, 8], [3, 4, 5, 6], [11]]
    whole = generate(cfg, variables, rows, max_new_tokens=6, temperature=5.0, stop_tokens=[], seed=1)
    share = generate(
        cfg, variables, rows[2:], max_new_tokens=6, temperature=5.0, stop_tokens=[], seed=1, first_stream=2
    )
    np.testing.assert_array_equal(share.tokens, whole.tokens[2:])
    np.testing.assert_allclose(share.logprobs, whole.logprobs[2:], atol=1e-5)


def test_generation_rejects_bad_requests_with_the_fix():
    cfg = tiny_config()
    variables = random_variables(cfg)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(cfg, variables, [[4], []])
    with pytest.raises(ValueError, match="left padding"):
        generate(cfg, variables, np.asarray([[4, 5, 0]]), attention_mask=np.asarray([[1, 1, 0]]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(cfg, variables, [[4, 5]], max_new_tokens=cfg.max_position_embeddings)
    with pytest.raises(ValueError, match="top_p"):
        generate(cfg, variables, [[4, 5]], top_p=0.0)
    with pytest.raises(ValueError, match="token ids must be in"):
        generate(cfg, variables, [[4, cfg.vocab_size]])


def test_lm_generate_and_zaya_generate_on_a_trained_run(tmp_path, capsys, monkeypatch):
    from tests.fixtures import MINI

    run = tmp_path / "run"
    assert main(["train", *MINI, f"run.dir={run}", "train.steps=2", "--no-progress"]) == 0
    lm = zaya_jax.load(run)
    out = lm.generate(["def ", "import"], max_new_tokens=5, stop_tokens=[])
    tok = lm.tokenizer
    assert out.tokens.shape == (2, 5) and out.texts == [tok.decode(row) for row in out.rows()]
    assert np.all(out.tokens < tok.vocab_size)  # the padded model vocabulary is never sampled

    capsys.readouterr()
    argv = ["generate", str(run), "--prompt", "def ", "--prompt", "import", "--max-new-tokens", "5"]
    assert main([*argv, "--stop", "999", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in results] == out.rows()
    assert [r["text"] for r in results] == out.texts and results[0]["prompt"] == "def "

    assert main(["generate", str(run), "--prompt", "x", "--top-k", "-1"]) == 2
    assert "top_k must be >= 0" in capsys.readouterr().err

    # --interactive: prompts from stdin, every one padded to the same width, so one compiled shape
    import io

    import zaya_jax.engine.scheduler as scheduler

    shapes, original = [], scheduler.decode_program

    def recording(cfg, shape):
        shapes.append(shape)
        return original(cfg, shape)

    monkeypatch.setattr(scheduler, "decode_program", recording)
    monkeypatch.setattr("sys.stdin", io.StringIO("def \nimport\n\n" + "y" * 40 + "\n"))
    interactive = [
        "generate",
        str(run),
        "--interactive",
        "--max-prompt-tokens",
        "16",
        "--max-new-tokens",
        "5",
    ]
    assert main([*interactive, "--stop", "999", "--json"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["tokens"] for line in lines] == out.rows()  # the same continuations as the batch above
    # one program shape (capacity 16 + 5) for both prompts; the 40-token prompt was refused, not run
    assert len(set(shapes)) == 1 and shapes[0].capacity == 21 and len(shapes) == 2
    assert "more than --max-prompt-tokens=16" in captured.err


def test_generation_stops_on_every_id_of_the_eos_list():
    """HF's eos_token_id may be a list (ZAYA1-8B: [1, 106]); the converter keeps it whole and
    generation stops on any of its ids by default."""
    from zaya_jax.interop.hf import hf_config_to_model, model_to_hf_config

    cfg = tiny_config()
    variables = random_variables(cfg, 3)
    free = generate(cfg, variables, [[5, 6, 7]], max_new_tokens=8, stop_tokens=[])
    emitted = free.tokens[0].tolist()
    first = emitted[2]  # an id it emits on its own, and another one (emitted later, if any)
    second = next((t for t in emitted[3:] if t != first), (first + 1) % cfg.vocab_size)
    hf = {**model_to_hf_config(cfg), "eos_token_id": [second, first]}
    listed = hf_config_to_model(hf)
    assert listed.eos_token_id == second and listed.stop_token_ids == (second, first)
    assert model_to_hf_config(listed)["eos_token_id"] == [second, first]  # exported as the same list
    out = generate(listed, variables, [[5, 6, 7]], max_new_tokens=8)
    stop_at = min(i for i, t in enumerate(free.tokens[0].tolist()) if t in (first, second))
    assert out.lengths[0] == stop_at + 1 and out.stopped[0]  # stopped at the first id of either kind
