"""The config tree: presets, inheritance, dotted overrides, validation errors that name the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from zaya_jax.config import (
    Config,
    ConfigError,
    ModelConfig,
    config_from_dict,
    dump_config,
    load_config,
    to_dict,
)


@pytest.mark.parametrize("name", ["tiny", "small", "zaya1-8b"])
def test_presets_load_and_validate(name):
    cfg = load_config(name)
    assert cfg.run.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_layers = 1  # type: ignore[misc]


def test_dotted_overrides_are_typed():
    cfg = load_config("tiny", ["model.num_layers=4", "optim.adam_lr=1e-3", "model.layer_types=null"])
    assert cfg.model.num_layers == 4
    assert cfg.optim.adam_lr == pytest.approx(1e-3)
    assert isinstance(cfg.optim.adam_lr, float)


def test_override_of_list_becomes_tuple():
    cfg = load_config(
        "tiny", ["model.layer_types=[hybrid, hybrid_sliding, hybrid, hybrid]", "model.sliding_window=8"]
    )
    assert cfg.model.layer_types == ("hybrid", "hybrid_sliding", "hybrid", "hybrid")


def test_inheritance_merges_over_parent(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("inherits: tiny\nmodel:\n  num_experts: 8\nrun:\n  name: child\n")
    cfg = load_config(str(child))
    tiny = load_config("tiny")
    assert cfg.model.num_experts == 8
    assert cfg.model.hidden_size == tiny.model.hidden_size  # untouched keys come from the parent
    assert cfg.run.name == "child"


def test_inheritance_cycle_is_reported(tmp_path):
    (tmp_path / "a.yaml").write_text(f"inherits: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"inherits: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(str(tmp_path / "a.yaml"))


def test_unknown_key_suggests_the_closest_name():
    with pytest.raises(ConfigError, match=r"'model\.num_layer'.*did you mean model\.num_layers"):
        load_config("tiny", ["model.num_layer=3"])


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match="unknown config key 'optimiser'"):
        load_config("tiny", ["optimiser.lr=1"])


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"available presets: .*tiny"):
        load_config("no-such-preset")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.num_layers=four", r"model\.num_layers='four' must be an integer"),
        ("model.num_layers=true", r"model\.num_layers=True must be an integer"),
        ("model.attention_bias=1", r"model\.attention_bias=1 must be true or false"),
        ("model.moe_impl=fast", r"model\.moe_impl='fast' is not allowed; choose one of 'dense' \| 'sorted'"),
        ("model.dtype=float16", r"model\.dtype='float16' is not allowed"),
    ],
)
def test_wrong_types_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.num_kv_heads=3"],
            r"num_kv_heads=3 does not divide model\.num_heads=4; use one of \[1, 2, 4\]",
        ),
        (["model.num_experts_per_tok=2"], r"num_experts_per_tok=2.*set model\.num_experts_per_tok=1"),
        (
            ["model.layer_types=[hybrid, hybrid_sliding, hybrid, hybrid]"],
            r"sliding_window is null; set model\.sliding_window",
        ),
        (["model.layer_types=[hybrid]"], r"layer_types has 1 entries but model\.num_layers=4"),
        (["model.partial_rotary_factor=0.3"], r"partial_rotary_factor=0.3 gives a rotary width of 9"),
        (["model.eos_token_id=264"], r"eos_token_id=264 must be in \[0, model\.vocab_size=264\)"),
        (["model.hidden_size=0"], r"hidden_size=0 must be a positive integer"),
        (["model.scan_unroll=0"], r"model.scan_unroll=0 must be a positive integer"),
        (["train.seq_len=4096"], r"train\.seq_len=4096 exceeds model\.max_position_embeddings=2048"),
    ],
)
def test_impossible_combinations_raise_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


def test_bad_override_syntax_is_explained():
    with pytest.raises(ConfigError, match=r"must look like section\.key=value"):
        load_config("tiny", ["model.num_layers"])


def test_resolved_config_round_trips_through_yaml():
    import yaml

    cfg = load_config(
        "tiny", ["model.layer_types=[hybrid, hybrid_sliding, hybrid, hybrid]", "model.sliding_window=5"]
    )
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg


def test_zaya1_8b_preset_holds_every_hf_zaya_config_default():
    transformers = pytest.importorskip("transformers")
    from zaya_jax.interop.hf import hf_config_to_model

    preset = load_config("zaya1-8b").model
    from_hf = hf_config_to_model(transformers.ZayaConfig().to_dict())
    ours_only = {"mod_skip_output", "moe_impl", "capacity_factor", "remat", "dtype", "param_dtype"}
    hf_values = to_dict(from_hf)  # both as plain YAML values (tuples as lists)
    differing = {
        k: (v, hf_values[k]) for k, v in to_dict(preset).items() if k not in ours_only and hf_values[k] != v
    }
    assert not differing
    assert ModelConfig() == dataclasses.replace(
        from_hf, dtype=ModelConfig.dtype
    )  # code defaults = HF defaults


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.micro_batches=3"], r"batch size 16 is not divisible by train\.micro_batches=3"),
        (
            ["train.batch_ramp=[{tokens: 100, batch_size: 4}, {tokens: 50, batch_size: 8}]"],
            r"batch_ramp token thresholds must increase strictly",
        ),
        (
            ["train.stages=[{tokens: 10, seq_len: 64, mixture: [1, 2]}]"],
            r"mixture has 2 weights for 1 data\.sources",
        ),
        (["data.sources=[]"], r"data\.sources is empty"),
        (
            ["data.sources=[{name: web, kind: jsonl}]"],
            r"data\.sources\[0\] \(web\) of kind 'jsonl' needs a path",
        ),
        (["optim.ns_coeffs=[1, 2]"], r"optim\.ns_coeffs must hold 3 numbers"),
        (["balancing.skip_target=1.5"], r"balancing\.skip_target=1\.5 must be in \[0, 1\)"),
        (["optim.schedule=linear"], r"optim\.schedule='linear' is not allowed"),
    ],
)
def test_training_sections_reject_impossible_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


def test_nested_lists_of_sections_are_typed():
    cfg = load_config(
        "tiny",
        [
            "data.sources=[{name: code, kind: text, path: /tmp/x, weight: 3}, {name: stdlib}]",
            "train.stages=[{tokens: 1000, seq_len: 64, mixture: [1, 0.5]}]",
        ],
    )
    assert cfg.data.sources[0].weight == 3.0 and cfg.data.sources[1].kind == "stdlib"
    assert cfg.train.stages[0].mixture == (1.0, 0.5)


def test_config_reference_is_generated_and_describes_every_key():
    from zaya_jax.config_reference import config_reference

    text = config_reference()
    committed = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"
    assert committed.read_text() == text, (
        "docs/CONFIG.md is stale: run `python -m zaya_jax.config_reference > docs/CONFIG.md`"
    )
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert all(not row.rstrip().endswith("|  |") for row in rows), "a config field has no comment"
    for section in dataclasses.fields(Config):
        for field in dataclasses.fields(section.default_factory):
            assert f"| `{section.name}.{field.name}` |" in text


def test_moved_keys_still_load_at_their_new_place_with_a_warning(tmp_path):
    """Cadence keys moved to their component's section (train.eval_every -> eval.every, ...): a
    run saved before the move, an old YAML and an old override load the same config, each warning
    with the new name; the usual precedence holds across the two spellings."""
    new = load_config("tiny", ["eval.every=7", "log.every=3", "log.trackers=[]", "profile.steps=[2, 3]"])
    saved = to_dict(new)
    old = {**saved, "train": dict(saved["train"]), "run": dict(saved["run"])}
    old["train"].update(eval_every=7, eval_batches=saved["eval"]["batches"], log_every=3)
    old["run"].update(trackers=[], project=saved["log"]["project"], profile_steps=[2, 3])
    old = {k: v for k, v in old.items() if k not in ("eval", "log", "profile")}
    with pytest.warns(FutureWarning, match=r"train\.eval_every is now eval\.every"):
        assert config_from_dict(old) == new
    with pytest.warns(FutureWarning, match=r"override 'train\.log_every=3'.*log\.every"):
        assert load_config("tiny", ["train.log_every=3"]).log.every == 3
    yaml_file = tmp_path / "old.yaml"
    yaml_file.write_text("inherits: tiny\ntrain:\n  eval_every: 9\n")
    with pytest.warns(FutureWarning, match=r"old\.yaml: config key train\.eval_every"):
        assert load_config(yaml_file).eval.every == 9
        assert load_config(yaml_file, ["eval.every=11"]).eval.every == 11  # the override still wins
    with pytest.raises(ConfigError, match=r"train\.eval_every and eval\.every are both set"):
        config_from_dict({"train": {"eval_every": 5}, "eval": {"every": 6}})
