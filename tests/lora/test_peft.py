"""LoRA adapters as Hugging Face PEFT directories: ``transformers`` + ``peft`` loading the base export
and the adapter gives zaya's logits of the merged weights (every role, a square expert ``wo``
included, where a transposed factor passes every shape check), and save -> load is exact."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import peft  # not importorskip: the suite pins peft (pyproject dev extras), a missing one is a failure
import pytest

from tests.fixtures import MINI
from tests.hf_reference import hf_logits, transformers
from zaya_jax.config import LoraConfig as Lora
from zaya_jax.config import load_config
from zaya_jax.interop.hf import save_hf_directory
from zaya_jax.lora import init_adapters, merge
from zaya_jax.lora.peft import PeftError, load_peft_adapter, save_peft_adapter
from zaya_jax.model import Zaya, init_variables

CFG = load_config("tiny", MINI).model  # hidden 32 == expert intermediate 32: wo is square
IDS = np.random.default_rng(3).integers(3, CFG.vocab_size, size=(2, 12))


def _variables():
    variables = init_variables(CFG, 0)
    # a trained-like CCA temperature: at 0 attention is uniform and q/k adapters change nothing
    variables["params"]["layers"]["attn"]["temp"] = jnp.full_like(
        variables["params"]["layers"]["attn"]["temp"], 0.5
    )
    return variables


def _random_adapters(params, lora, seed):
    """Random A and B (B nonzero), large enough to move the logits far beyond the tolerance."""
    adapters = init_adapters(params, lora, jax.random.key(seed))
    for i, factors in enumerate(adapters.values()):
        factors["b"] = 0.05 * jax.random.normal(jax.random.key(seed + 1 + i), factors["b"].shape)
    return adapters


def _zaya_logits(variables, params):
    logits, _ = Zaya(CFG).apply({**variables, "params": params}, jnp.asarray(IDS))
    return np.asarray(logits, np.float32)


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_model_on_the_hf_export_gives_the_merged_zaya_logits(tmp_path, rslora):
    assert CFG.hidden_size == CFG.moe_intermediate_size
    variables = _variables()
    lora = Lora(2, alpha=4.0, rslora=rslora)
    adapters = _random_adapters(variables["params"], lora, seed=10)
    save_hf_directory(tmp_path / "base", CFG, variables)
    save_peft_adapter(tmp_path / "adapter", CFG, adapters, lora)

    base = transformers.ZayaForCausalLM.from_pretrained(
        tmp_path / "base", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    base_logits = hf_logits(base, IDS)
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ours = _zaya_logits(variables, merge(variables["params"], adapters, lora))
    theirs = hf_logits(model, IDS)
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= 1e-4 * scale
    # the adapters matter: each role alone moves the logits by far more than the tolerance
    for role in ("experts", "attention"):
        only = {p: f for p, f in adapters.items() if (p.startswith("layers/experts")) == (role == "experts")}
        alone = dataclasses.replace(lora, targets=(role,))
        moved = _zaya_logits(variables, merge(variables["params"], only, alone)) - base_logits
        assert np.abs(moved).max() > 100 * 1e-4 * scale, role


def test_save_then_load_is_exact(tmp_path):
    params = _variables()["params"]
    lora = Lora(3, alpha=5.0, rslora=True)
    adapters = _random_adapters(params, lora, seed=20)
    save_peft_adapter(tmp_path, CFG, adapters, lora)
    loaded, settings = load_peft_adapter(tmp_path, CFG)
    assert Lora(**settings) == lora
    assert set(loaded) == set(adapters)
    for path, factors in adapters.items():
        for k in ("a", "b"):
            np.testing.assert_array_equal(loaded[path][k], np.asarray(factors[k]), err_msg=f"{path} {k}")

    experts_only = Lora(2, targets=("experts",))
    adapters = _random_adapters(params, experts_only, seed=30)
    save_peft_adapter(tmp_path / "experts", CFG, adapters, experts_only)
    loaded, settings = load_peft_adapter(tmp_path / "experts", CFG)
    assert Lora(**settings) == experts_only and set(loaded) == set(adapters)


def test_embedding_adapters_are_refused():
    params = _variables()["params"]
    lora = Lora(2, targets=("experts", "embeddings"))
    with pytest.raises(PeftError, match="LoRA targets embeddings have no PEFT export yet"):
        save_peft_adapter("/nonexistent", CFG, init_adapters(params, lora, jax.random.key(0)), lora)


def test_an_adapter_written_by_peft_itself_loads_with_its_logits(tmp_path):
    variables = _variables()
    save_hf_directory(tmp_path / "base", CFG, variables)
    base = transformers.ZayaForCausalLM.from_pretrained(
        tmp_path / "base", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    config = peft.LoraConfig(
        r=2,
        lora_alpha=3,
        target_modules=["q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,  # random A and B
    )
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(tmp_path / "adapter")
    adapters, settings = load_peft_adapter(tmp_path / "adapter", CFG)
    lora = Lora(**settings)
    assert lora == Lora(2, alpha=3.0)
    assert all(np.any(factors["b"]) for factors in adapters.values())
    ours = _zaya_logits(variables, merge(variables["params"], adapters, lora))
    theirs = hf_logits(model, IDS)
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()
