"""Tiny Hugging Face ``ZayaForCausalLM`` models with every tensor randomised, for parity tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Spec §6.1: a tiny config that HF accepts, with a sliding-window layer.
TINY_HF = dict(
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=1,
    router_hidden_size=16,
    max_position_embeddings=256,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    layer_types=["hybrid", "hybrid_sliding", "hybrid"],
    sliding_window=4,
    rope_parameters={
        "hybrid": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        "hybrid_sliding": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    },
)


def _randomise(name: str, t: Any, gen: Any) -> Any:
    """A random value for every tensor, including those HF initialises to constants (spec §6.2)."""
    noise = torch.randn(t.shape, generator=gen, dtype=torch.float64)
    if name.endswith("balancing_biases"):
        value = 0.02 * noise
        value[-1] -= 1.0  # keep the skip class rare unless a test forces it
        return value
    if name.endswith("qk_norm.temp"):
        return 1.0 + 0.5 * noise
    if t.ndim == 1 and ("scale" in name or "norm" in name):
        return 1.0 + 0.2 * noise
    if t.ndim == 1:  # biases
        return 0.2 * noise
    fan_in = t.shape[-1] if "conv" not in name else t.shape[1] * t.shape[2]
    if name.endswith("embed_tokens.weight"):
        fan_in = 1
    return noise / np.sqrt(fan_in)


def make_hf_model(seed: int = 0, dtype: Any = None, **overrides: Any):
    """A randomised HF ZayaForCausalLM (eager attention and experts) in eval mode."""
    cfg = transformers.ZayaConfig(**{**TINY_HF, **overrides})
    model = transformers.ZayaForCausalLM._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.state_dict().items()):
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            tensor.copy_(_randomise(name, tensor, gen).to(tensor.dtype))
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    """The model's state dict as float32 numpy arrays (bf16 values are exactly representable)."""
    return {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(ids),
            attention_mask=None if attention_mask is None else torch.as_tensor(attention_mask),
            use_cache=False,
        )
    return out.logits.to(torch.float32).numpy()
