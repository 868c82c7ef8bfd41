"""``zaya eval``: loss/perplexity of a saved model on held-out or given text."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

import zaya_jax
from tests.train.test_loop import MINI
from zaya_jax.cli import main
from zaya_jax.data import ByteTokenizer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", *MINI, f"run.dir={path}", "train.steps=2", "--no-progress"]) == 0
    return path


def test_eval_on_given_text_equals_the_mean_cross_entropy(run, tmp_path, capsys):
    text = "def add(a, b):\n    return a + b  # ünï\n" * 3
    (tmp_path / "doc.txt").write_text(text)
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(tmp_path / "doc.txt"), "--seq-len", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)

    tok = ByteTokenizer()
    ids = tok.encode(text)
    targets = np.append(ids[1:], tok.eos_id)  # every document's last token predicts EOS
    logits = zaya_jax.load(run).logits(ids[None])[0]
    nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets[:, None], axis=-1)[:, 0]
    assert result["tokens"] == len(ids)
    assert result["loss"] == pytest.approx(float(nll.mean()), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))


def test_eval_defaults_to_the_runs_held_out_split(run, capsys):
    capsys.readouterr()
    assert main(["eval", str(run), "--seq-len", "32", "--batches", "2", "--batch-size", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 2 * 2 * 32
    assert 0 < result["loss"] < 10


def test_eval_of_a_missing_path_is_a_clear_error(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope"), "--json"]) == 2
    assert "does not exist" in capsys.readouterr().err
