"""``zaya convert`` writes its output beside the destination and renames it into place: what a
killed conversion leaves (a staging directory and a free lock) is cleared by the rerun, a rerun over
a finished conversion succeeds when the result is identical, and anything else is refused."""

from __future__ import annotations

import numpy as np
import pytest

import zaya_jax
from bench.campaigns.sigkill import MINI, same_files
from zaya_jax.cli import main
from zaya_jax.config import load_config
from zaya_jax.interop.hf import save_hf_directory
from zaya_jax.model import init_variables
from zaya_jax.staging import lock_path, staging_path

IDS = np.arange(3, 15)[None]


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    cfg = load_config("tiny", [o for o in MINI if o.startswith("model.")]).model
    return save_hf_directory(tmp_path_factory.mktemp("src") / "hf", cfg, init_variables(cfg, 3))


def _leave_a_killed_conversion(destination):
    staging = staging_path(destination)
    staging.mkdir(parents=True)
    (staging / "config.json").write_text("{}")  # looks like an HF directory, but is never used
    (staging / "model.safetensors.tmp").write_bytes(b"half")
    lock_path(destination).write_text("999999 zaya convert\n")


def test_a_killed_conversion_is_cleared_by_the_rerun_both_ways(hf_source, tmp_path):
    run = tmp_path / "run"
    _leave_a_killed_conversion(run)
    assert main(["convert", "hf-to-zaya", str(hf_source), str(run)]) == 0
    hf = tmp_path / "hf"
    _leave_a_killed_conversion(hf)
    assert main(["convert", "zaya-to-hf", str(run), str(hf)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    assert same_files(hf, hf_source)  # HF -> zaya -> HF gives the same bytes
    np.testing.assert_array_equal(zaya_jax.load(run).logits(IDS), zaya_jax.load(hf_source).logits(IDS))


def test_a_rerun_over_a_finished_conversion_succeeds_when_identical(hf_source, tmp_path, capsys):
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["convert", "hf-to-zaya", str(hf_source), str(run)]) == 0
    assert main(["convert", "zaya-to-hf", str(run), str(hf)]) == 0
    written = {p: p.stat().st_mtime_ns for p in [*run.rglob("*"), *hf.rglob("*")]}
    # the job was requeued after it had finished: both commands succeed and change nothing
    assert main(["convert", "hf-to-zaya", str(hf_source), str(run)]) == 0
    assert main(["convert", "zaya-to-hf", str(run), str(hf)]) == 0
    assert {p: p.stat().st_mtime_ns for p in [*run.rglob("*"), *hf.rglob("*")]} == written
    capsys.readouterr()
    # a different result is refused, and the destination left as it was
    assert main(["convert", "zaya-to-hf", str(run), str(hf), "--dtype", "bfloat16"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["convert", "hf-to-zaya", str(hf_source), str(run), "--set", "model.rms_norm_eps=0.001"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in [*run.rglob("*"), *hf.rglob("*")]} == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
