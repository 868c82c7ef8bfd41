"""The ``lora`` section: the presets, and the combinations that are refused with the reason."""

from __future__ import annotations

import pytest

from zaya_jax.config import ConfigError, load_config


@pytest.mark.parametrize("preset", ["lora-sft", "lora-grpo"])
def test_lora_presets_need_their_base(preset):
    with pytest.raises(
        ConfigError, match=r"needs train.init_from .*the base model the adapters are trained on"
    ):
        load_config(preset)
    cfg = load_config(preset, ["train.init_from=runs/sft"])
    assert cfg.lora.enabled and cfg.lora.targets == ("experts", "attention") and not cfg.balancing.enabled
    assert cfg.lora.scale == 2.0


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (
            ["lora.targets=[experts, router]"],
            "'router' is refused: the router picks each token's expert by an argmax",
        ),
        (
            ["lora.targets=[balancing]"],
            "'balancing' is refused: the balancing biases are set by the balancing controller",
        ),
        (["lora.targets=[eda]"], "'eda' is refused"),
        (["lora.targets=[mlp]"], "unknown role 'mlp'; the roles are experts, attention, embeddings"),
        (["lora.targets=[]"], "lora.targets is empty"),
        (["lora.rank=-2"], "lora.rank=-2 must be an integer >= 0"),
        (["lora.alpha=0"], "lora.alpha=0.0 must be a finite number > 0"),
        (
            ["balancing.enabled=true"],
            "balancing biases are part of the frozen base .* set balancing.enabled=false",
        ),
    ],
)
def test_impossible_lora_settings_are_refused_with_the_reason(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config("lora-sft", ["train.init_from=runs/sft", *overrides])
