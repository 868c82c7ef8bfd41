"""``zaya train --init-from``: a fresh run starting from the weights of a run or an HF directory,
with the model config taken from the source and a clear error when an override contradicts it."""

from __future__ import annotations

import json

import jax
import numpy as np
import yaml

import zaya_jax
from tests.fixtures import MINI
from zaya_jax.cli import main

# The learning rate warms up from 0 at the first step: that one step leaves the loaded parameters
# exactly as they were.
FROZEN = ["optim.warmup_steps=5", "train.steps=1", "eval.batches=1", "--no-progress"]
# The run shape of MINI without its model.* entries (the model must come from the source).
SHAPE = [o for o in MINI if not o.startswith("model.")]


def _params(path) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(zaya_jax.load(path).variables["params"])]


def _events(run) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def test_init_from_a_run_and_from_its_hf_export(tmp_path, capsys):
    source = tmp_path / "source"
    assert (
        main(
            [
                "train",
                *MINI,
                f"run.dir={source}",
                "train.steps=2",
                "profile.steps=[2, 2]",
                "--no-progress",
            ]
        )
        == 0
    )
    expected = _params(source)
    assert list((source / "profile" / "process_0").rglob("*.xplane.pb"))  # the profiled step's trace

    fine_tuned = tmp_path / "fine_tuned"
    assert main(["train", *SHAPE, "--init-from", str(source), f"run.dir={fine_tuned}", *FROZEN]) == 0
    saved = yaml.safe_load((fine_tuned / "config.yaml").read_text())
    assert saved["train"]["init_from"] == str(source)
    assert saved["model"] == yaml.safe_load((source / "config.yaml").read_text())["model"]  # not the preset's
    assert all(np.array_equal(a, b) for a, b in zip(_params(fine_tuned), expected, strict=True))
    started = [e["detail"] for e in _events(fine_tuned) if e["event"] == "init_from"]
    assert started == [{"source": str(source), "format": "zaya", "step": 2}]

    hf = tmp_path / "hf"
    assert main(["convert", "zaya-to-hf", str(source), str(hf)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(hf), "--json"]) == 0  # inspect takes what eval and generate take
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "hf" and report["config"]["model"]["num_layers"] == 2
    assert report["arrays"]["tensors"]["model.embed_tokens.weight"][0] == [264, 32]
    from_hf = tmp_path / "from_hf"
    # the fine-tuning preset, given MaxText's way (a positional preset), with the source as an override
    assert main(["train", "finetune", *SHAPE, f"train.init_from={hf}", f"run.dir={from_hf}", *FROZEN]) == 0
    assert all(np.array_equal(a, b) for a, b in zip(_params(from_hf), expected, strict=True))
    capsys.readouterr()

    # A model.* override that contradicts the weights is refused, naming the leaf.
    clash = tmp_path / "clash"
    assert (
        main(
            ["train", *SHAPE, "--init-from", str(source), f"run.dir={clash}", "model.num_experts=4", *FROZEN]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "train.init_from" in err and "['experts']" in err and "model.*" in err

    # The converted-style run (weights, no training state) itself is not trained in place: the
    # refusal says how to start from it.
    converted = tmp_path / "converted"
    assert main(["convert", "hf-to-zaya", str(hf), str(converted)]) == 0
    assert main(["train", *SHAPE, f"run.dir={converted}", *FROZEN]) == 2
    assert f"--init-from {converted}" in capsys.readouterr().err
