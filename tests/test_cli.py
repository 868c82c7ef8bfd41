"""The ``zaya`` command: optimizer report, errors for people, data preparation."""

from __future__ import annotations

import json

import jax

from zaya_jax.cli import main
from zaya_jax.config import load_config
from zaya_jax.model import abstract_variables


def test_inspect_optimizer_lists_every_leaf_with_group_and_matrix_axes(capsys):
    assert main(["inspect", "--config", "zaya1-8b", "--optimizer", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["optimizer"]
    params = abstract_variables(load_config("zaya1-8b").model)["params"]
    paths = {
        "/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert set(groups) == paths
    wi = groups["layers/experts/wi"]
    assert wi["group"] == "muon" and wi["matrix_axes"] == ["embed", "expert_mlp"]
    assert wi["batch_axes"] == ["layers", "experts"] and wi["shape"] == [40, 16, 2048, 4096]
    for adamw in ("embedding", "layers/attn/temp", "layers/attn/conv_dw_kernel", "layers/router/out/kernel"):
        assert groups[adamw]["group"] == "adamw" and groups[adamw]["matrix_axes"] is None, adamw
    assert groups["layers/router/fc1/kernel"]["group"] == "muon"


def test_router_group_moves_router_matrices_to_adamw(capsys):
    assert main(["inspect", "--config", "tiny", "optim.router_group=adamw", "--optimizer", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["optimizer"]
    assert groups["layers/router/fc1/kernel"]["group"] == "adamw"
    assert groups["layers/attn/q_proj/kernel"]["group"] == "muon"


def test_config_errors_exit_2_with_the_fix(capsys):
    assert main(["inspect", "--config", "tiny", "model.num_kv_heads=3"]) == 2
    assert "use one of [1, 2, 4]" in capsys.readouterr().err


def test_data_prepare_writes_shards_and_manifest(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("def f():\n    return 1\n")
    (docs / "b.txt").write_text("hello ünïcode")
    assert main(["data", "prepare", str(docs), "--out", str(tmp_path / "out"), "--shards", "2"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert len(manifest["shards"]) == 2
    assert sum(s["records"] for s in manifest["shards"]) == 2
    assert capsys.readouterr().out


def test_doctor_reports_versions_and_registered_kernels(capsys):
    from zaya_jax.cli import main as cli_main

    assert cli_main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "cpu" and report["devices"]
    assert report["kernels"]["cpu"] == "registered"
    assert set(report["kernels"]) == {"cpu", "cuda", "rocm"}
    assert report["recommended_xla_flags"] == {}  # nothing recommended for the CPU
    assert isinstance(report["plugins"], dict)


def test_doctor_refuses_a_silent_cpu_fallback_when_a_gpu_is_required(capsys):
    from zaya_jax.cli import main as cli_main

    assert cli_main(["doctor", "--require-gpu"]) == 1
    assert "a GPU was required but JAX runs on the CPU" in capsys.readouterr().err
