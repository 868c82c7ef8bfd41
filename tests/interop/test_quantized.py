"""Experts exported in FP8 and MXFP4 (compressed-tensors): the formats against a NumPy reference,
the exports decompressed by compressed-tensors itself and loaded into transformers against zaya's
quantized forward, read back by zaya, and damaged or mismatched directories refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import zaya_jax
from tests.hf_reference import hf_logits, make_hf_model, torch, transformers
from zaya_jax.interop.hf import ConversionError, save_hf_directory
from zaya_jax.interop.hf.quantized import export_bytes
from zaya_jax.interop.safetensors_io import read_directory, write_directory
from zaya_jax.ops import quantization as q

ct = pytest.importorskip("compressed_tensors")
IDS = np.random.default_rng(5).integers(3, 97, size=(2, 12))
KINDS = {"fp8-experts": "fp8", "mxfp4-experts": "mxfp4"}


# ---- the formats, against NumPy (ml_dtypes' float8 e4m3fn and float4 e2m1fn round to nearest even)


def _fp8_reference(w: np.ndarray) -> np.ndarray:
    """Rows are output channels, columns inputs: a scale amax / 448 per row (eps for a zero row)."""
    scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(448)
    scale = np.where(scale == 0, np.finfo(np.float32).eps, scale).astype(np.float32)
    codes = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return codes.astype(np.float32) * scale


def _mxfp4_reference(w: np.ndarray) -> np.ndarray:
    """Groups of 32 inputs: scale 2^(floor(log2 amax') - 2), amax' = amax rounded up to the next
    power of two when its mantissa is >= 1.75; codes clip(w / s, ±6) rounded to e2m1."""
    groups = w.reshape(w.shape[0], -1, 32)
    amax = np.abs(groups).max(axis=-1, keepdims=True).astype(np.float64)
    mantissa, exponent = np.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = np.where(mantissa >= 0.875, exponent, exponent - 1)  # floor(log2), rounded up at 1.75
    biased = np.where(amax > 2.0**-126, np.clip(exponent + 127 - 2, 0, 254), 0)
    scale = np.exp2(biased - 127.0).astype(np.float32)
    codes = np.clip(groups / scale, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (codes * scale).reshape(w.shape)


def _edge_rows() -> np.ndarray:
    """Ties, saturation, subnormal codes, a zero row and group, and a group whose amax's mantissa is
    just under and at 1.75 (the E8M0 exponent rounds up at 1.75)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 64)) * 0.02).astype(np.float32)
    w[1] = 0.0  # a zero channel: scale eps, every code 0
    w[2, :32] = 0.0  # a zero MX group: exponent byte 0
    w[3, :32] = np.float32(1.7) * 4 * np.linspace(-1, 1, 32)  # amax 6.8: scale 1, 6.8 saturates to 6
    w[4, :32] = np.float32(1.75) * 4  # amax 7: rounds the exponent up (scale 2), 3.5 per 2 -> 4
    w[5, :32] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, np.float32)  # e2m1 ties
    w[6, :4] = [448.0, 1e-3, -(2.0**-9) * 448 / 448, 224.0]  # fp8 subnormal codes (2^-9 is e4m3's least)
    w[7, 32:] = 1e-41  # float32 subnormal inputs
    return w


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_formats_round_trip_as_the_numpy_reference(kind):
    reference = {"fp8": _fp8_reference, "mxfp4": _mxfp4_reference}[kind]
    random = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    # groups far from 1 need exact powers of two (jnp.exp2 is not exact at 1e-5 or 1e5)
    for w in (_edge_rows(), random * np.float32(0.05), random * np.float32(1e-5), random * np.float32(1e5)):
        # our kernels take (in, out) with the input axis given: here axis 0 of w.T
        ours = np.asarray(q.quantize_dequantize(jnp.asarray(w.T), kind, 0)).T
        np.testing.assert_array_equal(ours, reference(w))
    edges = np.asarray(q.quantize_dequantize(jnp.asarray(_edge_rows().T), kind, 0)).T
    assert not edges[1].any()
    if kind == "mxfp4":
        assert edges[3, :32].max() == 6.0 and edges[4, 0] == 8.0  # saturated; the scale rounded up
        np.testing.assert_array_equal(edges[5, :8], [0, 1, 1, 2, 2, 4, 4, 6])  # ties to even
        exponents = np.asarray(q.mxfp4_exponents(jnp.asarray(_edge_rows().T), 0))  # (rows, groups)
        assert exponents[2, 0] == 0 and exponents[3, 0] == 127 and exponents[4, 0] == 128
    else:
        assert edges[6, 0] == 448.0 and edges[6, 3] == 224.0


def test_the_gradient_passes_straight_through():
    w = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64, 8)), jnp.float32)
    grad = np.asarray(__import__("jax").grad(lambda x: (q.quantize_dequantize(x, "mxfp4", 1) * w).sum())(w))
    np.testing.assert_array_equal(grad, np.asarray(w))


# ---- exports, checked from outside


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A randomised HF model (moe_intermediate_size 64: MXFP4 groups of 32) read by zaya."""
    path = tmp_path_factory.mktemp("quantized") / "hf"
    make_hf_model(seed=31, moe_intermediate_size=64).save_pretrained(path)
    with warnings.catch_warnings():  # its skip biases are not -1: the exports below anchor them
        warnings.simplefilter("ignore")
        return zaya_jax.load(path)


def _torch(value: np.ndarray):
    """A NumPy array (ml_dtypes' float8 and bfloat16 included) as a torch tensor, bit for bit."""
    kinds = {
        ml_dtypes.float8_e4m3fn: (np.uint8, torch.float8_e4m3fn),
        ml_dtypes.bfloat16: (np.uint16, torch.bfloat16),
    }
    for dtype, (raw, torch_dtype) in kinds.items():
        if value.dtype == dtype:
            return torch.from_numpy(value.view(raw).copy()).view(torch_dtype)
    return torch.from_numpy(np.ascontiguousarray(value))


def _decompressed(directory) -> dict:
    """The export's tensors with its experts decompressed by compressed-tensors' own compressor,
    under the scheme its config.json gives (stacked experts as one 2-D matrix per layer)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    scheme = parsed.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(parsed.format)
    tensors = read_directory(directory)
    out = {}
    for base in sorted({n.split(".weight_")[0] for n in tensors if ".mlp.experts." in n}):
        parts = {
            ("weight" if n == base else n[len(base) + 1 :]): v
            for n, v in tensors.items()
            if n.split(".weight_")[0] == base
        }
        experts, rows = next(iter(parts.values())).shape[:2]
        torch_parts = {local: _torch(v).reshape(experts * rows, -1) for local, v in parts.items()}
        out[base] = compressor.decompress(torch_parts, scheme)["weight"].float().reshape(experts, rows, -1)
    for name, value in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = torch.from_numpy(np.asarray(value, np.float32))
    return out


@pytest.mark.parametrize("quantize", list(KINDS))
def test_compressed_tensors_decompresses_the_export_to_zaya_quantized_forward(tmp_path, model, quantize):
    out = tmp_path / quantize
    save_hf_directory(out, model.config, model.variables, dtype="float32", quantize=quantize)
    config = json.loads((out / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert group["input_activations"] is None and group["targets"] == ["re:.*experts.*"]
    tensors = read_directory(out)
    layer = "model.layers.1.mlp.experts.gate_up_proj"
    if quantize == "fp8-experts":
        assert tensors[layer].dtype == ml_dtypes.float8_e4m3fn and tensors[layer].shape == (4, 128, 64)
        assert tensors[layer + ".weight_scale"].shape == (4, 128, 1)
    else:
        assert tensors[layer + ".weight_packed"].shape == (4, 128, 32)
        assert tensors[layer + ".weight_scale"].dtype == np.uint8 and tensors[
            layer + ".weight_scale"
        ].shape == (4, 128, 2)
    assert (
        sum(v.nbytes for v in tensors.values())
        == export_bytes(model.config, KINDS[quantize], "float32")["total"]
    )

    # transformers' ZayaForCausalLM holds compressed-tensors' dequantized weights, every key matched
    hf_config = {
        k: v
        for k, v in config.items()
        if k not in ("quantization_config", "architectures", "model_type", "dtype")
    }
    hf = transformers.ZayaForCausalLM._from_config(
        transformers.ZayaConfig(**hf_config), attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float32,
    ).eval()  # fmt: skip
    missing, unexpected = hf.load_state_dict(_decompressed(out), strict=False)
    assert list(missing) == ["lm_head.weight"] and not unexpected  # the head is tied
    quantized = dataclasses.replace(
        model, config=dataclasses.replace(model.config, expert_quantization=KINDS[quantize])
    )
    ours = quantized.logits(IDS)
    scale = np.abs(ours).max()
    assert np.abs(hf_logits(hf, IDS) - ours).max() / scale <= 1e-4
    # it is the quantized model: the float one is further away than the check's tolerance
    assert np.abs(model.logits(IDS) - ours).max() / scale > 1e-3
    # zaya reads the export back (float8 through ml_dtypes, MXFP4 unpacked by NumPy) as that model
    back = zaya_jax.load(out)
    assert back.config.expert_quantization == KINDS[quantize]
    np.testing.assert_allclose(back.logits(IDS), ours, rtol=0, atol=1e-5 * scale)


def test_sizes_at_zaya1_8b_shapes_meet_the_goals():
    """The export's tensor bytes from shapes alone (checked against real files above), at ZAYA1-8B's
    shapes: FP8 at most 0.55 and MXFP4 at most 0.35 of the bfloat16 export (5.85 GB, Zyphra's 5.9)."""
    cfg = zaya_jax.ModelConfig()
    bf16 = export_bytes(cfg)["total"]
    assert export_bytes(cfg, "fp8")["total"] / bf16 <= 0.55
    assert export_bytes(cfg, "mxfp4")["total"] / bf16 <= 0.35


def _claims_mxfp4(config: dict) -> None:
    """An FP8 directory's config rewritten to say MXFP4."""
    quant = config["quantization_config"]
    quant["format"] = "mxfp4-pack-quantized"
    quant["config_groups"]["group_0"]["weights"].update(num_bits=4, strategy="group", group_size=32)


def test_damaged_and_mismatched_quantized_directories_are_one_line(tmp_path, model):
    good = tmp_path / "good"
    save_hf_directory(good, model.config, model.variables, quantize="fp8-experts")
    tensors = read_directory(good)
    scale = "model.layers.0.mlp.experts.down_proj.weight_scale"

    def variant(name, change_tensors=None, change_config=None):
        path = tmp_path / name
        shutil.copytree(good, path)
        if change_tensors is not None:
            (path / "model.safetensors").unlink()
            write_directory(path, change_tensors({**tensors}))
        if change_config is not None:
            config = json.loads((path / "config.json").read_text())
            change_config(config)
            (path / "config.json").write_text(json.dumps(config))
        return path

    def nan_scale(t):
        t[scale] = np.where(np.arange(t[scale].size).reshape(t[scale].shape) == 3, np.nan, t[scale]).astype(
            np.float32
        )
        return t

    cases = {
        "nan": (nan_scale, None, rf"{scale} holds values that are not finite and > 0"),
        "shape": (lambda t: {**t, scale: t[scale][:, :-1]}, None, rf"{scale} is float32 \[4, 63, 1\]; its weight needs"),
        "missing": (lambda t: {k: v for k, v in t.items() if k != scale}, None, r"down_proj is stored as .*down_proj; its format needs .*weight_scale"),
        "mxfp4 config": (None, _claims_mxfp4, r"is stored as .*; its format needs .*weight_packed"),
        "no config": (None, lambda c: c.pop("quantization_config"), r"has no quantization_config, but .* are quantized tensors"),
        "activations": (None, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "weight-only"),
    }  # fmt: skip
    group = ("quantization_config", "config_groups", "group_0")

    def in_group(**fields):
        return lambda c: c[group[0]][group[1]][group[2]].update(fields)

    cases["targets"] = (None, in_group(targets="re:.*experts.*"), "targets 're:.*experts.*' are not a list")
    cases["format"] = (None, lambda c: c[group[0]].update(format="pack-quantized"), "format 'pack-quantized'")
    for name, (tensors_change, config_change, message) in cases.items():
        path = variant(name.replace(" ", "_"), tensors_change, config_change)
        with pytest.raises(ConversionError, match=message) as caught:
            zaya_jax.load(path)
        assert "\n" not in str(caught.value), name
    # shards: a layer's codes and scales may sit in different files
    sharded = tmp_path / "sharded"
    save_hf_directory(sharded, model.config, model.variables, quantize="fp8-experts", max_shard_bytes=20_000)
    assert len(list(sharded.glob("*.safetensors"))) > 2
    np.testing.assert_array_equal(zaya_jax.load(sharded).logits(IDS), zaya_jax.load(good).logits(IDS))
    # MXFP4 needs widths that are multiples of 32: refused before anything is written
    narrow = dataclasses.replace(model.config, moe_intermediate_size=48)
    with pytest.raises(ConversionError, match="multiples of 32"):
        save_hf_directory(tmp_path / "narrow", narrow, model.variables, quantize="mxfp4-experts")
    assert not (tmp_path / "narrow").exists()
    # a model that reads its experts as FP8 is not exported as another format
    fp8 = dataclasses.replace(model.config, expert_quantization="fp8")
    with pytest.raises(ConversionError, match="export it with quantize 'fp8-experts'"):
        save_hf_directory(tmp_path / "other", fp8, model.variables, quantize="mxfp4-experts")
    with pytest.raises(zaya_jax.ConfigError, match="multiples of 32"):
        dataclasses.replace(model.config, expert_quantization="mxfp4", moe_intermediate_size=48).validate()


def test_a_run_exported_quantized_evaluated_and_refused_as_a_starting_point(tmp_path, capsys):
    """zaya convert --quantize of a run (experts packed, the rest bfloat16); zaya eval --quantize
    reports what it changes; train.init_from refuses the export unless asked to dequantize it, and
    then starts a model that computes in full precision."""
    from zaya_jax.cli import main
    from zaya_jax.config import load_config
    from zaya_jax.train.init import check_source, source_model_config

    hf, run, export = tmp_path / "hf", tmp_path / "run", tmp_path / "mxfp4"
    make_hf_model(seed=32, moe_intermediate_size=64, vocab_size=264).save_pretrained(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the random skip biases (see the module's fixture)
        assert main(["convert", "hf-to-zaya", str(hf), str(run)]) == 0
    assert main(["convert", "zaya-to-hf", str(run), str(export), "--quantize", "mxfp4-experts"]) == 0
    tensors = read_directory(export)
    assert str(tensors["model.embed_tokens.weight"].dtype) == "bfloat16"
    assert tensors["model.layers.0.mlp.experts.down_proj.weight_packed"].dtype == np.uint8
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    converted = zaya_jax.load(run)
    quantized = dataclasses.replace(
        converted, config=dataclasses.replace(converted.config, expert_quantization="mxfp4")
    )
    ids = np.random.default_rng(0).integers(3, 259, size=(2, 16))
    ours = quantized.logits(ids)
    # the export's other weights are bfloat16: near the run's quantized forward, not equal to it
    assert 0 < np.abs(zaya_jax.load(export).logits(ids) - ours).max() / np.abs(ours).max() < 1e-2

    capsys.readouterr()
    shape = ["--seq-len", "32", "--batch-size", "2", "--batches", "2", "--tokenizer", "byte"]
    assert main(["eval", str(run), "--quantize", "fp8-experts", "--json", *shape]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = converted.config
    assert report["size_ratio"] == pytest.approx(
        export_bytes(cfg, "fp8")["total"] / export_bytes(cfg)["total"]
    )
    assert report["route_change_by_layer"][0] == 0.0 and 0 < report["greedy_agreement"] <= 1
    assert set(report["loss"]) == {"bfloat16", "fp8-experts"} and report["tokens"] == 2 * 2 * 32

    start = [
        "train",
        "train.steps=1",
        "--no-progress",
        "--init-from",
        str(export),
        f"run.dir={tmp_path / 'r'}",
    ]
    assert main(start) == 2
    assert "holds its experts quantized (mxfp4)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    allowed = load_config("tiny", [f"train.init_from={export}", "train.init_dequantized=true"])
    check_source(allowed)  # no error: asked for
    assert source_model_config(export).expert_quantization == "none"  # trains in full precision


def test_fp8_with_bfloat16_scales_reads_as_compressed_tensors_decompresses_it(tmp_path, model):
    """llm-compressor writes bfloat16 scales for a bfloat16 model: the code times its scale in
    bfloat16. zaya reads those weights as they are (expert_quantization none: quantizing them again
    with float32 scales would move most of them), equal to compressed-tensors' decompress."""
    path = tmp_path / "bf16_scales"
    save_hf_directory(path, model.config, model.variables, dtype="float32", quantize="fp8-experts")
    tensors = read_directory(path)
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)
    (path / "model.safetensors").unlink()
    write_directory(path, tensors)
    loaded = zaya_jax.load(path)
    assert loaded.config.expert_quantization == "none"
    reference = _decompressed(path)
    ours = loaded.variables["params"]["layers"]["experts"]["wi"][1]  # (E, H, 2I): HF's transposed
    theirs = reference["model.layers.1.mlp.experts.gate_up_proj"].numpy().transpose(0, 2, 1)
    np.testing.assert_array_equal(np.asarray(ours), theirs)
