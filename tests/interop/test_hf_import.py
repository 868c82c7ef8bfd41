"""Inbound HF interop: ``zaya convert hf-to-zaya`` and ``zaya_jax.load`` on save_pretrained and legacy
ZAYA1-base layouts give HF's logits; bad checkpoints get errors that list every offending tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import zaya_jax
from tests.hf_reference import hf_logits, make_hf_model, state_dict_numpy, torch
from zaya_jax.cli import main
from zaya_jax.interop.hf import ConversionError, hf_config_to_model, hf_to_variables
from zaya_jax.interop.safetensors_io import SafetensorsError, read_directory, read_safetensors

IDS = np.random.default_rng(0).integers(3, 97, size=(2, 10))


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=11)


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(path)
    return path


def test_save_pretrained_omits_the_tied_head(hf_dir):
    assert "lm_head.weight" not in read_directory(hf_dir)


def test_convert_cli_then_load_gives_hf_logits(hf_model, hf_dir, tmp_path, capsys):
    dst = tmp_path / "converted"
    assert main(["convert", "hf-to-zaya", str(hf_dir), str(dst)]) == 0
    assert (dst / "config.yaml").is_file() and (dst / "checkpoints" / "0").is_dir()
    lm = zaya_jax.load(dst)
    assert lm.step == 0 and lm.config.num_layers == 3
    err = np.abs(lm.logits(IDS) - hf_logits(hf_model, IDS)).max()
    assert err < 1e-4, err
    # also through the step directory itself
    np.testing.assert_array_equal(zaya_jax.load(dst / "checkpoints" / "0").logits(IDS), lm.logits(IDS))

    capsys.readouterr()
    assert main(["inspect", str(dst), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 0
    assert report["arrays"]["params"]["embedding"] == [[97, 64], "float32"]
    assert report["arrays"]["balancing"]["layers"]["router"]["biases"] == [[3, 5], "float32"]


def test_convert_refuses_a_non_empty_destination(hf_dir, tmp_path):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    with pytest.raises(SystemExit, match="not empty"):
        main(["convert", "hf-to-zaya", str(hf_dir), str(dst)])
    assert (dst / "keep.txt").read_text() == "precious"


def test_load_reads_an_hf_directory_directly(hf_model, hf_dir):
    err = np.abs(zaya_jax.load(hf_dir).logits(IDS) - hf_logits(hf_model, IDS)).max()
    assert err < 1e-4, err


def test_left_padded_batch_through_the_python_api(hf_model, hf_dir):
    mask = np.ones_like(IDS)
    mask[0, :4] = 0
    ours = zaya_jax.load(hf_dir).logits(IDS, attention_mask=mask)
    ref = hf_logits(hf_model, IDS, attention_mask=mask)
    assert np.abs(ours - ref)[mask == 1].max() < 1e-4


def test_bf16_safetensors_are_read_exactly(tmp_path):
    value = torch.randn(5, 3).to(torch.bfloat16)
    from safetensors.torch import save_file as torch_save

    torch_save({"w": value}, str(tmp_path / "x.safetensors"))
    read = read_safetensors(tmp_path / "x.safetensors")["w"]
    np.testing.assert_array_equal(read.astype(np.float32), value.to(torch.float32).numpy())


def _legacy_state(sd: dict, layers: int) -> dict:
    """The legacy half-layer names, written out independently of the converter (spec §6.3)."""
    out = {
        "model.embed_tokens.weight": sd["model.embed_tokens.weight"],
        "model.final_norm.weight": sd["model.norm.weight"],
        "model.layers.0.res_scale.hidden_states_scale": sd["model.input_hidden_states_scale"],
        "model.layers.0.res_scale.hidden_states_bias": sd["model.input_hidden_states_bias"],
    }
    parts = ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")
    for i in range(layers):
        new, att, moe = f"model.layers.{i}.", f"model.layers.{2 * i}.", f"model.layers.{2 * i + 1}."
        out[att + "input_norm.weight"] = sd[new + "input_layernorm.weight"]
        for old, hf in [
            ("linear_q", "q_proj"),
            ("linear_k", "k_proj"),
            ("val_proj1", "v_proj_current"),
            ("val_proj2", "v_proj_delayed"),
        ]:
            out[f"{att}self_attn.qkv.{old}.weight"] = sd[f"{new}self_attn.qkv_proj.{hf}.weight"]
        for k, hf in [("0", "conv_qk_depthwise"), ("1", "conv_qk_grouped")]:
            for p in ("weight", "bias"):
                out[f"{att}self_attn.qkv.conv_qk.{k}.{p}"] = sd[f"{new}self_attn.qkv_proj.{hf}.{p}"]
        out[att + "self_attn.qkv.temp"] = sd[new + "self_attn.qk_norm.temp"]
        out[att + "self_attn.o_proj.weight"] = sd[new + "self_attn.o_proj.weight"]
        out[moe + "input_norm.weight"] = sd[new + "post_attention_layernorm.weight"]
        router = moe + "zaya_block.router."
        out[router + "down_proj.weight"] = sd[new + "mlp.gate.down_proj.weight"]
        out[router + "down_proj.bias"] = sd[new + "mlp.gate.down_proj.bias"]
        if i > 0:
            out[router + "router_states_scale"] = sd[new + "mlp.gate.router_states_scale"]
        out[router + "rmsnorm_eda.weight"] = sd[new + "mlp.gate.router_mlp.norm.weight"]
        for k, hf in [("0", "fc1"), ("2", "fc2")]:
            for p in ("weight", "bias"):
                out[f"{router}router_mlp.{k}.{p}"] = sd[f"{new}mlp.gate.router_mlp.{hf}.{p}"]
        out[router + "router_mlp.4.weight"] = sd[new + "mlp.gate.router_mlp.out_proj.weight"]
        out[router + "balancing_biases"] = sd[new + "mlp.gate.balancing_biases"]
        for e in range(sd[new + "mlp.experts.gate_up_proj"].shape[0]):
            expert = f"{moe}zaya_block.experts.local_experts.{e}."
            out[expert + "linear_fc1.weight"] = sd[new + "mlp.experts.gate_up_proj"][e]
            out[expert + "linear_fc2.weight"] = sd[new + "mlp.experts.down_proj"][e]
        next_res = f"model.layers.{2 * i + 2}.res_scale." if i < layers - 1 else "model.res_scale."
        for part in parts:
            out[f"{moe}res_scale.{part}"] = sd[f"{new}post_attention_residual_scale.{part}"]
            out[next_res + part] = sd[f"{new}post_mlp_residual_scale.{part}"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def test_legacy_zaya1_base_layout_converts_to_hf_logits(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    hf = make_hf_model(
        seed=12,
        layer_types=None,
        sliding_window=None,
        rope_parameters={"hybrid": rope, "hybrid_sliding": rope},
    )
    src = tmp_path / "legacy"
    src.mkdir()
    save_file(_legacy_state(state_dict_numpy(hf), 3), str(src / "model.safetensors"))
    legacy_config = {
        "model_type": "zaya",
        "zaya_layers": ["a", 4] * 3,
        "cca_num_q_heads": [4, 0] * 3,
        "num_query_groups_list": [2, 0] * 3,
        "ffn_hidden_size_list": [0, 96] * 3,
        "zaya_mlp_expansion": [0, 16] * 3,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 97,
        "rope_theta": 1e4,
        "max_position_embeddings": 256,
        "eos_token_id": 1,
    }
    (src / "config.json").write_text(json.dumps(legacy_config))
    dst = tmp_path / "converted"
    assert main(["convert", "hf-to-zaya", str(src), str(dst)]) == 0
    err = np.abs(zaya_jax.load(dst).logits(IDS) - hf_logits(hf, IDS)).max()
    assert err < 1e-4, err


def test_mismatched_checkpoints_list_every_offending_tensor(hf_model):
    cfg = hf_config_to_model(hf_model.config.to_dict())
    sd = state_dict_numpy(hf_model)
    del sd["model.layers.1.self_attn.qk_norm.temp"]
    sd["model.layers.0.mlp.gate.router_states_scale"] = np.ones(16, np.float32)  # block 0 has no EDA
    sd["model.layers.2.mlp.experts.down_proj"] = np.zeros((4, 64, 47), np.float32)
    with pytest.raises(ConversionError) as info:
        hf_to_variables(sd, cfg)
    message = str(info.value)
    assert "missing 1: model.layers.1.self_attn.qk_norm.temp" in message
    assert "unexpected 1: model.layers.0.mlp.gate.router_states_scale" in message
    assert "mis-shaped 1: model.layers.2.mlp.experts.down_proj (4, 64, 47) (expected (4, 64, 48))" in message


def test_corrupt_safetensors_are_rejected_with_the_path(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(SafetensorsError, match=r"model\.safetensors: not a readable safetensors file"):
        read_safetensors(bad)


def test_shard_index_cannot_point_outside_the_directory(tmp_path):
    index = {"weight_map": {"w": "../elsewhere.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="outside"):
        read_directory(tmp_path)


def test_pickle_checkpoints_are_not_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "zaya"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(SafetensorsError, match="never pickle"):
        read_directory(tmp_path)


def test_generation_config_supplies_the_eos_list(hf_dir, tmp_path):
    import shutil

    from zaya_jax.interop.hf import hf_directory_model

    copy = tmp_path / "copy"
    shutil.copytree(hf_dir, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    cfg = hf_directory_model(copy)
    assert cfg.eos_token_ids == (1, 5) and {1, 5} <= set(cfg.stop_token_ids)


def test_a_model_converted_without_a_tokenizer_has_none_and_samples_its_whole_vocabulary(tmp_path, capsys):
    """No tokenizer.json beside the weights: the run has no tokenizer (not a guessed byte one, whose
    259 ids would cap sampling of a 512-id model), so sampling from ids takes the model's argmax
    over its whole vocabulary, and a text prompt says what to give."""
    hf = make_hf_model(seed=4, vocab_size=512)
    src, dst = tmp_path / "hf", tmp_path / "run"
    hf.save_pretrained(src)
    assert main(["convert", "hf-to-zaya", str(src), str(dst)]) == 0
    lm = zaya_jax.load(dst)
    assert lm.tokenizer is None and "no tokenizer" in lm.tokenizer_problem
    ids = np.random.default_rng(3).integers(3, 500, size=(4, 12))
    expected = lm.logits(ids)[:, -1].argmax(-1)
    assert (expected >= 259).any()  # what a byte tokenizer's limit would have changed
    out = lm.generate(ids.tolist(), max_new_tokens=1, temperature=0.0)
    np.testing.assert_array_equal([row[0] for row in out.rows()], expected)
    with pytest.raises(ValueError, match="no tokenizer"):
        lm.generate("hello", max_new_tokens=1)


def test_a_model_converted_with_its_tokenizer_keeps_it(tmp_path):
    from tests.data.corpora import train_bpe_tokenizer
    from zaya_jax.data import HFTokenizer

    hf = make_hf_model(seed=5, vocab_size=320)
    src, dst = tmp_path / "hf", tmp_path / "run"
    hf.save_pretrained(src)
    train_bpe_tokenizer(src / "tokenizer.json", vocab_size=300)
    assert main(["convert", "hf-to-zaya", str(src), str(dst)]) == 0
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    lm = zaya_jax.load(dst)
    original = HFTokenizer(src / "tokenizer.json")
    assert lm.tokenizer.vocab_size == original.vocab_size and lm.tokenizer.eos_id == original.eos_id
    assert main(["convert", "hf-to-zaya", str(src), str(dst)]) == 0  # a rerun over it matches
