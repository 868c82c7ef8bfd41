"""``zaya inspect --config ... --json`` parameter counts equal the HF reference's, from shapes only."""

from __future__ import annotations

import json

import pytest

from zaya_jax.cli import main
from zaya_jax.config import load_config


def test_zaya1_8b_counts_match_hf_reference(capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    assert main(["inspect", "--config", "zaya1-8b", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)

    with torch.device("meta"):  # shapes only, no memory
        hf = transformers.ZayaForCausalLM(transformers.ZayaConfig())
    total = sum(p.numel() for p in hf.parameters())  # tied head counted once
    embedding = hf.model.embed_tokens.weight.numel()
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    cfg = hf.config
    active = total - embedding - experts * (cfg.num_experts - 1) // cfg.num_experts

    assert ours["total_params"] == total == 8_840_488_784
    assert ours["non_embedding_params"] == total - embedding == 8_303_355_728
    assert ours["active_params"] == active == 753_608_528


def test_counts_follow_overrides(capsys):
    assert main(["inspect", "--config", "tiny", "model.num_experts=8", "--json"]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert main(["inspect", "--config", "tiny", "--json"]) == 0
    four = json.loads(capsys.readouterr().out)
    cfg = load_config("tiny").model
    expert_params = cfg.num_layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    router_row = cfg.num_layers * cfg.router_hidden_size  # one more router class per extra expert
    assert eight["total_params"] - four["total_params"] == 4 * (expert_params + router_row)
    assert eight["active_params"] == four["active_params"] + 4 * router_row
    assert eight["config"]["model"]["num_experts"] == 8
