"""The ``zaya`` command: optimizer report, errors for people, data preparation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    # a kernel built for a platform with no device here (a CPU-only test run) is not "registered"
    assert report["kernels"]["cuda"].startswith(("built, no device", "not built"))
    assert report["recommended_xla_flags"] == {}  # nothing recommended for the CPU
    assert isinstance(report["plugins"], dict)


def test_every_recommended_xla_flag_is_known_to_the_installed_jaxlib(capsys):
    """An unknown flag in XLA_FLAGS aborts JAX at start; every flag doctor recommends, on every
    platform, starts it (on the CPU, where GPU flags are parsed and ignored)."""
    from zaya_jax.cli import main as cli_main
    from zaya_jax.cli.doctor import RECOMMENDED_XLA_FLAGS, timeout_settings

    flags = [flag for table in RECOMMENDED_XLA_FLAGS.values() for flag in table]
    flags += timeout_settings("rocm")[1]  # runtime.collective_timeout_s's flags
    assert any("ragged_all_to_all_one_shot_kernel=false" in f for f in RECOMMENDED_XLA_FLAGS["cuda"])
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    proc = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.numpy.ones(2).sum())"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "2.0" in proc.stdout, proc.stderr[-2000:]
    bad = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.numpy.ones(2).sum())"],
        capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": "--xla_gpu_no_such_flag=1"}, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0  # the check above would catch a misspelt flag
    assert cli_main(["doctor", "--flags-for", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "one_shot_kernel=false" in out and "openxla/xla#47283" in out
    assert cli_main(["doctor", "--flags-for", "rocm"]) == 0
    out = capsys.readouterr().out
    assert "runtime.collective_timeout_s=1200" in out and "NCCL_IB_TIMEOUT=22" in out
    assert "--xla_gpu_executable_terminate_timeout=1200" in out


def test_doctor_refuses_a_silent_cpu_fallback_when_a_gpu_is_required(capsys):
    from zaya_jax.cli import main as cli_main

    assert cli_main(["doctor", "--require-gpu"]) == 1
    assert "a GPU was required but JAX runs on the CPU" in capsys.readouterr().err


def test_version(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("zaya-jax ")


def test_flags_may_follow_overrides_and_configs_come_in_every_shape(tmp_path):
    from zaya_jax.cli import build_parser
    from zaya_jax.cli.argv import parse as _parse
    from zaya_jax.cli.argv import positional_config as _positional_config

    def parsed(*argv):
        args = _parse(build_parser(), list(argv))
        _positional_config(args)
        return args

    args = parsed("train", "train.steps=6", "--no-progress", "run.dir=R")  # argparse's intermixed parsing
    assert args.no_progress and args.overrides == ["train.steps=6", "run.dir=R"] and args.config == "tiny"
    args = parsed("train", "small", "train.steps=3")  # MaxText's shape: a preset first
    assert args.config == "small" and args.overrides == ["train.steps=3"]
    args = parsed("train", str(tmp_path / "my.yaml"), "k.v=1")
    assert args.config == str(tmp_path / "my.yaml") and args.overrides == ["k.v=1"]
    args = parsed("train", "--train.steps", "10", "--optim.adam_lr=0.1", "--no-progress")  # Levanter's shape
    assert args.overrides == ["train.steps=10", "optim.adam_lr=0.1"] and args.no_progress


def test_errors_name_the_subcommand(capsys):
    assert main(["supervise", "--"]) == 2
    assert capsys.readouterr().err.startswith("zaya supervise: nothing to supervise")


def test_an_override_without_a_value_is_a_clear_error(capsys):
    assert main(["inspect", "--config", "tiny", "model.num_layers"]) == 2
    assert "must look like section.key=value" in capsys.readouterr().err


def test_convert_reports_bad_hf_configs_with_the_file(tmp_path, capsys):
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text(json.dumps({"model_type": "zaya", "vocab_size": 10}))
    assert main(["convert", "hf-to-zaya", str(incomplete), str(tmp_path / "out1")]) == 2
    err = capsys.readouterr().err
    assert "config.json lacks the field" in err and str(incomplete) in err
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "config.json").write_bytes('{"model_type": "zaya", "name": "café"}'.encode("latin-1"))
    assert main(["convert", "hf-to-zaya", str(latin), str(tmp_path / "out2")]) == 2
    assert str(latin / "config.json") in capsys.readouterr().err


def test_warmup_longer_than_the_run_is_warned_about():
    from zaya_jax.train.schedule import plan_warnings

    assert plan_warnings(load_config("tiny", ["train.steps=100", "optim.warmup_steps=20"])) == []
    (warning,) = plan_warnings(load_config("tiny", ["train.steps=10", "optim.warmup_steps=20"]))
    assert "optim.warmup_steps=20 >= train.steps=10" in warning


def test_notebooks_run_the_cli_through_this_interpreter():
    """A kernel started as the venv's python without its bin/ on PATH has no `zaya` executable."""
    from pathlib import Path

    for notebook in sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        assert '["zaya"' not in code and "['zaya'" not in code, notebook.name


def test_data_prepare_reads_compressed_jsonl_with_a_text_field_and_can_skip_bad_lines(tmp_path, capsys):
    import gzip

    import zstandard

    lines = [json.dumps({"body": "first document"}), "not json", json.dumps({"body": "second ünï"})]
    data = ("\n".join(lines) + "\n").encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    inputs = [str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.jsonl.zst")]
    assert main(["data", "prepare", *inputs, "--out", str(tmp_path / "strict"), "--text-field", "body"]) == 2
    err = capsys.readouterr().err
    assert "a.jsonl.gz:2" in err and "--on-bad-document skip" in err
    assert not (tmp_path / "strict").exists()  # nothing half-written is left
    args = [
        "--out",
        str(tmp_path / "out"),
        "--text-field",
        "body",
        "--on-bad-document",
        "skip",
        "--shards",
        "1",
    ]
    assert main(["data", "prepare", *inputs, *args]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["documents"] == 4 and manifest["skipped_documents"] == 2
    expected = len(b"first document") + len("second ünï".encode())
    assert manifest["tokens"] == 2 * expected  # byte tokens of the text, not of the compressed bytes


def test_help_config_lists_keys_with_their_meaning_and_presets_suggest_a_spelling(capsys):
    assert main(["train", "--help-config", "optim"]) == 0
    out = capsys.readouterr().out
    assert "optim.warmup_steps (int, default 20)" in out and "linear warmup steps" in out
    assert "train.steps" not in out  # one section only
    assert main(["train", "--help-config"]) == 0
    assert "runtime.compilation_cache_dir" in capsys.readouterr().out
    assert main(["inspect", "--config", "tinny"]) == 2
    assert "did you mean 'tiny'?" in capsys.readouterr().err
