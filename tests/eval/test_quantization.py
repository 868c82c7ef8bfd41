"""What quantizing the experts changes (zaya_jax.eval.quantization), on models where it is known:
experts already on the MXFP4 grid change nothing; a router whose two best classes (the skip class
and an expert) tie within far less than the quantization's effect moves tokens between them, in
the layers after the first only, counted per layer as the two models' own routes say."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures import synthetic_batch
from tests.random_model import tiny_config, varied_variables
from zaya_jax.eval.quantization import exported_variables, quantization_report
from zaya_jax.lm import LanguageModel
from zaya_jax.model import Zaya
from zaya_jax.ops.quantization import quantize_dequantize

CFG = tiny_config(moe_intermediate_size=32)  # MXFP4 groups of 32 inputs
BATCHES = [
    {k: np.asarray(v) for k, v in synthetic_batch(seed, 4, 32, CFG.vocab_size).items()} for seed in (0, 1)
]


def _with(variables: dict, params=None, balancing=None) -> dict:
    return {
        **variables,
        "params": params or variables["params"],
        "balancing": balancing or variables["balancing"],
    }


def _choices(cfg, variables, batch) -> np.ndarray:
    """(layers, batch, seq) the class each layer chose, real tokens only (-1 elsewhere)."""
    _, state = jax.jit(functools.partial(Zaya(cfg).apply, mutable=["intermediates"]))(
        variables,
        jnp.asarray(batch["inputs"]),
        token_mask=jnp.asarray(batch["segment_ids"] > 0),
        segment_ids=jnp.asarray(batch["segment_ids"]),
        positions=jnp.asarray(batch["positions"]),
    )
    choice = np.asarray(state["intermediates"]["layers"]["router_choice"][0])
    return np.where(batch["segment_ids"][None] > 0, choice, -1)


def test_experts_on_the_mxfp4_grid_change_nothing():
    variables = varied_variables(CFG)
    experts = variables["params"]["layers"]["experts"]  # (layers, experts, in, out): inputs on axis 2
    gridded = {name: quantize_dequantize(w, "mxfp4", axis=2) for name, w in experts.items()}
    params = {**variables["params"], "layers": {**variables["params"]["layers"], "experts": gridded}}
    # the same weights in both models; two programs, which XLA may round differently by an ulp
    report = quantization_report(LanguageModel(CFG, _with(variables, params)), "mxfp4-experts", BATCHES)
    token = 1 / report["tokens"]
    assert report["route_change_by_layer"][0] == 0.0 and report["route_change_by_layer"][1] <= token
    assert report["greedy_agreement"] >= 1 - token and abs(report["loss_change"]) < 1e-6
    # the same model with its experts off the grid does change: the check above has teeth
    moved = quantization_report(LanguageModel(CFG, variables), "mxfp4-experts", BATCHES)
    assert abs(moved["loss_change"]) > 1e-4


def test_a_router_tie_under_the_quantization_error_moves_tokens_in_and_out_of_the_skip_class():
    # MXFP4 only: the report counts routes alike for both formats, and FP8's forward is checked
    # against transformers in tests/interop/test_quantized.py
    quantize = "mxfp4-experts"
    variables = varied_variables(CFG)
    skip = CFG.num_experts
    params = jax.tree.map(np.array, variables["params"])
    out = params["layers"]["router"]["out"]["kernel"]  # (layers, R, E + 1)
    out[1, :, skip] = out[1, :, 0] + 1e-4 * np.random.default_rng(0).standard_normal(out.shape[1])
    biases = np.array(variables["balancing"]["layers"]["router"]["biases"])
    biases[1, [0, skip]] = 10.0  # layer 1: every token picks expert 0 or the skip class, by a hair
    lm = LanguageModel(CFG, _with(variables, params, {"layers": {"router": {"biases": biases}}}))
    report = quantization_report(lm, quantize, BATCHES)

    kind = "mxfp4"
    models = (
        (CFG, exported_variables(lm.variables, keep_experts=False)),
        (
            dataclasses.replace(CFG, expert_quantization=kind),
            exported_variables(lm.variables, keep_experts=True),
        ),
    )
    before, after = (np.concatenate([_choices(c, v, b) for b in BATCHES], axis=1) for c, v in models)
    real = before[0] >= 0
    assert set(np.unique(before[1][real])) == {0, skip} == set(np.unique(after[1][real]))
    expected = [float(((b != a) & real).sum() / real.sum()) for b, a in zip(before, after, strict=True)]
    # Another program of the same model: XLA may fuse it otherwise, and a token tied within an
    # ulp may then go the other way; two such tokens are allowed.
    token = 2 / real.sum()
    assert report["route_change_by_layer"] == pytest.approx(expected, abs=token)
    assert report["route_change_by_layer"][0] == 0.0  # the first router reads no expert's output
    assert expected[1] > 0.01
    skips = report["skip_share_by_layer"]
    assert 0 < skips["bfloat16"][1] < 1 and skips["bfloat16"][1] != skips[quantize][1]
    assert skips["bfloat16"][1] == pytest.approx(float((before[1][real] == skip).mean()), abs=token)
    assert skips[quantize][1] == pytest.approx(float((after[1][real] == skip).mean()), abs=token)
    assert report["route_change"] == pytest.approx(sum(report["route_change_by_layer"]) / 2)
