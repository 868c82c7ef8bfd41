"""Mesh configuration: auto-filled axis, layout divisibility errors at config load, the rules table."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zaya_jax
from zaya_jax.config import ConfigError
from zaya_jax.parallel import DEFAULT_RULES, logical_rules, make_mesh, mesh_sizes
from zaya_jax.parallel.rules import zero1_shardings


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


@pytest.mark.parametrize(
    ("sizes", "experts", "dense"),
    [
        # ZeRO-1 on one node at 131k: context 8 alone splits the layer stack (distributed Muon
        # keeps whole matrices); before, data=1 left the optimizer state whole on every device.
        ((1, 1, 1, 8), P("context", None, None, None), P("context", None, None)),
        # 64 devices, data 8 x context 8: data takes the layers (40 / 8), context the experts
        # (16 / 8); a dense weight's context share falls on its first matrix axis.
        ((8, 1, 1, 8), P("data", "context", None, None), P("data", "context", None)),
        # an axis that already splits the parameter (expert) is left as it is
        ((2, 1, 2, 2), P(("data", "context"), "expert", None, None), P(("data", "context"), None, None)),
    ],
)
def test_zero1_splits_the_optimizer_state_over_data_and_context(sizes, experts, dense):
    mesh = jax.sharding.AbstractMesh(sizes, ("data", "fsdp", "expert", "context"))
    expert_spec = P(None, "expert") if sizes[2] > 1 else P()
    params = {
        "wi": jax.ShapeDtypeStruct((40, 16, 64, 128), "float32"),
        "o_proj": jax.ShapeDtypeStruct((40, 64, 32), "float32"),
        "norm": jax.ShapeDtypeStruct((3,), "float32"),  # no dimension divides: left as stored
    }
    stored = {
        "wi": NamedSharding(mesh, expert_spec),
        "o_proj": NamedSharding(mesh, P()),
        "norm": NamedSharding(mesh, P()),
    }
    shares = zero1_shardings(params, stored, mesh)
    assert shares["wi"].spec == experts
    assert shares["o_proj"].spec == dense
    assert shares["norm"] is stored["norm"]


def test_runtime_flags_are_applied_to_xla_flags_and_recorded(tmp_path, capsys):
    import json
    import os
    import subprocess
    import sys

    from tests.fixtures import MINI

    run = tmp_path / "run"
    flags = [
        "runtime.all_reduce_combine_threshold_bytes=1048576",
        "runtime.xla_flags=[--xla_cpu_use_thunk_runtime=true]",
    ]
    cmd = [sys.executable, "-m", "zaya_jax.cli", "train", *MINI, f"run.dir={run}", "train.steps=1", *flags]
    result = subprocess.run(
        [*cmd, "--no-progress"], capture_output=True, text=True, timeout=600, env=dict(os.environ)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (run / "events.jsonl").read_text().splitlines()
    (start,) = [json.loads(line) for line in lines if json.loads(line)["event"] == "start"]
    assert start["event"] == "start"
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=1048576" in start["detail"]["xla_flags"]
    assert "--xla_cpu_use_thunk_runtime=true" in start["detail"]["xla_flags"]
    assert start["detail"]["runtime"]["heartbeat_timeout_s"] == 100


def test_runtime_flags_after_jax_started_are_refused():
    from zaya_jax.parallel.distributed import apply_runtime

    jax.devices()  # this test process's backend is running
    runtime = zaya_jax.load_config("tiny", overrides=["runtime.all_gather_combine_threshold_bytes=1"]).runtime
    with pytest.raises(ConfigError, match="must be set before JAX starts"):
        apply_runtime(runtime, env={})
    with pytest.raises(ConfigError, match="must look like --xla_NAME=VALUE"):
        zaya_jax.load_config("tiny", overrides=["runtime.xla_flags=[fast]"])
