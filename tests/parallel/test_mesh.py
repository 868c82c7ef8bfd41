"""Mesh configuration: auto-filled axis, layout divisibility errors at config load, the rules table."""

from __future__ import annotations

import jax
import pytest

import zaya_jax
from zaya_jax.config import ConfigError
from zaya_jax.parallel import DEFAULT_RULES, logical_rules, make_mesh, mesh_sizes


def test_one_axis_is_filled_with_the_devices_left():
    cfg = zaya_jax.load_config("tiny", overrides=["mesh.expert=2", "mesh.fsdp=2"]).mesh
    assert mesh_sizes(cfg, 16) == {"data": 4, "fsdp": 2, "expert": 2, "context": 1}
    with pytest.raises(ConfigError, match="does not divide the device count"):
        mesh_sizes(cfg, 6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mesh.expert=3"], "num_experts=4 is not divisible by mesh.expert=3"),
        (["mesh.data=1", "mesh.fsdp=32"], "make every batch size a multiple of 32"),
        (["mesh.context=3"], "sequence length 128 is not divisible by mesh.context=3"),
        (["mesh.data=-1", "mesh.fsdp=-1"], "at most one axis may be auto-filled"),
        (["mesh.fsdp=0"], "mesh.fsdp=0 must be a positive size"),
        (["mesh.rules=[{name: embed, mesh: [tensor]}]"], "unknown mesh axes"),
    ],
)
def test_impossible_layouts_fail_at_config_load_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        zaya_jax.load_config("tiny", overrides=overrides)


def test_a_fixed_mesh_must_use_every_device():
    cfg = zaya_jax.load_config("tiny", overrides=["mesh.data=2"])
    with pytest.raises(ConfigError, match="2 but 1 devices"):
        make_mesh(cfg, jax.devices()[:1])


def test_rules_override_the_default_table():
    cfg = zaya_jax.load_config("tiny", overrides=["mesh.rules=[{name: vocab, mesh: [fsdp]}]"])
    rules = dict(logical_rules(cfg.mesh))
    assert rules["vocab"] == ("fsdp",) and rules["embed"] == ("fsdp",)
    assert dict(DEFAULT_RULES)["vocab"] == ()
