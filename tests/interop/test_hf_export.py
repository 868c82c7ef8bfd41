"""Outbound HF interop: ``zaya convert zaya-to-hf`` writes a directory that ``transformers`` loads with
the same logits; HF -> zaya -> HF keeps every tensor (the balancing biases up to one shift per layer)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest

import zaya_jax
from tests.hf_reference import hf_logits, make_hf_model, state_dict_numpy, torch, transformers
from zaya_jax.cli import main
from zaya_jax.interop.hf import ConversionError, load_hf_directory, save_hf_directory
from zaya_jax.interop.safetensors_io import read_directory, read_safetensors

IDS = np.random.default_rng(1).integers(3, 97, size=(2, 10))


def test_hf_to_zaya_to_hf_round_trip_is_exact(tmp_path):
    original = make_hf_model(seed=21)
    original.save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-zaya", str(tmp_path / "hf"), str(tmp_path / "zaya")]) == 0
    assert main(["convert", "zaya-to-hf", str(tmp_path / "zaya"), str(tmp_path / "back")]) == 0
    # A file whose skip biases are not -1 is read as written, with a warning that transformers will
    # not (it resets them to -1); the anchored export reads alike in both, without one.
    with pytest.warns(UserWarning, match=r"3 of 3 layers have a skip-class balancing bias other than -1"):
        load_hf_directory(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_hf_directory(tmp_path / "back")

    # The files are identical tensor for tensor, except that each layer's balancing biases are
    # shifted by one constant so that the skip class's is -1, the value transformers 5.24 sets after
    # loading (the source's is -1 + noise): the differences between classes are kept ...
    written, source = (
        read_safetensors(tmp_path / "back" / "model.safetensors"),
        read_directory(tmp_path / "hf"),
    )
    assert set(written) == set(source)
    for name in source:
        if name.endswith("balancing_biases"):
            assert written[name][-1] == -1.0 and source[name][-1] != -1.0, name
            gaps = written[name] - written[name][-1], source[name] - source[name][-1]
            np.testing.assert_allclose(*gaps, rtol=0, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(written[name], source[name], err_msg=name)
    # ... transformers loads every tensor as written, the biases included ...
    back = transformers.ZayaForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    before, after = state_dict_numpy(original), state_dict_numpy(back)
    assert set(before) == set(after)
    for name in before:
        expected = written[name] if name.endswith("balancing_biases") else before[name]
        np.testing.assert_array_equal(after[name], expected, err_msg=name)
    # ... and the shifted biases select the same classes. Equal weights, but two transformers
    # instances need not give bit-equal logits: on AVX-512 CPUs they differ by up to ~6e-6 (HF's own
    # save_pretrained -> from_pretrained does the same).
    np.testing.assert_allclose(hf_logits(back, IDS), hf_logits(original, IDS), rtol=0, atol=2e-5)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "zaya" and config["layer_types"][1] == "hybrid_sliding"


def test_a_model_whose_controller_moved_the_skip_bias_exports_with_the_same_logits(tmp_path):
    """transformers sets the skip class's balancing bias to -1 after loading; the export's biases
    are shifted so that it already is, so plain from_pretrained gives zaya's logits."""
    from tests.fixtures import MINI

    run = tmp_path / "run"
    # A router with clear preferences (initializer_range 0.5) and a controller fast enough (gains 5,
    # 30% of tokens wanted on the skip class) to move the skip class's bias well away from -1 in 4 steps.
    controller = ["balancing.skip_target=0.3", "balancing.kp=5", "balancing.ki=5"]
    args = [*MINI, "model.initializer_range=0.5", *controller, "train.steps=4", f"run.dir={run}"]
    assert main(["train", *args, "--no-progress"]) == 0
    lm = zaya_jax.load(run)
    biases = np.asarray(lm.variables["balancing"]["layers"]["router"]["biases"])  # (layers, E+1)
    assert np.all(biases[:, -1] > -0.75), biases

    assert main(["convert", "zaya-to-hf", str(run), str(tmp_path / "hf")]) == 0
    hf = transformers.ZayaForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    loaded = np.stack([np.asarray(layer.mlp.gate.balancing_biases) for layer in hf.model.layers])
    np.testing.assert_array_equal(loaded[:, -1], -1.0)
    np.testing.assert_allclose(loaded - loaded[:, -1:], biases - biases[:, -1:], rtol=0, atol=1e-6)

    ids = np.random.default_rng(2).integers(3, 259, size=(4, 32))
    ours = lm.logits(ids)
    scale = np.abs(ours).max()
    assert np.abs(hf_logits(hf, ids) - ours).max() / scale <= 1e-5
    # Read back into zaya, the export is the same model: its biases, shifted by a constant per layer,
    # select the same classes (bit-equal logits under the run's compile settings, e.g. scan_unroll).
    read_back = zaya_jax.load(tmp_path / "hf").variables
    np.testing.assert_array_equal(dataclasses.replace(lm, variables=read_back).logits(ids), ours)
    # The test has teeth: the trained biases with the skip class's alone set to -1 (what
    # transformers made of an unshifted export) route these tokens differently.
    reset = {**lm.variables, "balancing": {"layers": {"router": {"biases": biases.copy()}}}}
    reset["balancing"]["layers"]["router"]["biases"][:, -1] = -1.0
    assert np.abs(dataclasses.replace(lm, variables=reset).logits(ids) - ours).max() / scale > 1e-2


def test_bfloat16_export_keeps_balancing_biases_in_float32(tmp_path):
    original = make_hf_model(seed=22)
    original.save_pretrained(tmp_path / "hf")
    lm = zaya_jax.load(tmp_path / "hf")
    save_hf_directory(tmp_path / "bf16", lm.config, lm.variables, dtype="bfloat16")
    tensors = read_safetensors(tmp_path / "bf16" / "model.safetensors")
    assert str(tensors["model.layers.0.mlp.experts.gate_up_proj"].dtype) == "bfloat16"
    assert tensors["model.layers.0.mlp.gate.balancing_biases"].dtype == np.float32
    back = transformers.ZayaForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert back.model.layers[0].mlp.gate.balancing_biases.dtype == torch.float32


def test_export_refuses_what_hf_cannot_express_and_existing_directories(tmp_path):
    original = make_hf_model(seed=23)
    original.save_pretrained(tmp_path / "hf")
    lm = zaya_jax.load(tmp_path / "hf")
    with pytest.raises(ConversionError, match="scaled_input"):
        save_hf_directory(
            tmp_path / "x", dataclasses.replace(lm.config, mod_skip_output="scaled_input"), lm.variables
        )
    with pytest.raises(FileExistsError, match="not empty"):
        save_hf_directory(tmp_path / "hf", lm.config, lm.variables)


def test_a_sharded_export_has_an_index_and_loads_in_transformers(tmp_path):
    original = make_hf_model(seed=23)
    original.save_pretrained(tmp_path / "hf")
    lm = zaya_jax.load(tmp_path / "hf")
    save_hf_directory(tmp_path / "one", lm.config, lm.variables)
    save_hf_directory(tmp_path / "sharded", lm.config, lm.variables, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0].startswith("model-00001-of-")
    whole, pieces = read_directory(tmp_path / "one"), read_directory(tmp_path / "sharded")
    assert set(pieces) == set(index["weight_map"]) == set(whole)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in whole.values())
    for name in whole:
        np.testing.assert_array_equal(pieces[name], whole[name], err_msg=name)
    back = transformers.ZayaForCausalLM.from_pretrained(
        tmp_path / "sharded", attn_implementation="eager"
    ).eval()
    np.testing.assert_allclose(hf_logits(back, IDS), hf_logits(original, IDS), rtol=0, atol=2e-5)
