"""``zaya eval RUN --data PAIRS.jsonl`` of a preference run: the pairs scored by the run's own loss
(dpo's references from its starting weights, checked against the fingerprint the run recorded),
the same metrics as its held-out evaluation; what it cannot score is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

import zaya_jax
from tests.fixtures import MINI
from zaya_jax.cli import main
from zaya_jax.config import DataConfig, DataSource
from zaya_jax.data import load_tokenizer, tokenized_documents
from zaya_jax.data.chat import ChatEncoder, find_chat_template
from zaya_jax.data.preference import PreferenceEncoder
from zaya_jax.data.tasks import reverse_pairs, write_jsonl
from zaya_jax.objectives import GivenData, SavedRun, spec_for
from zaya_jax.objectives.held_out import evaluate_held_out

BYTE = load_tokenizer("byte")
TOO_LONG = {"prompt": "reverse: " + "q" * 200, "chosen": "a", "rejected": "b"}  # 400+ tokens: no row of 128


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """A dpo run of 2 steps (the second at the peak learning rate, so its rewards are not 0) on 10
    pairs, 4 of them held out and evaluated once each (2 batches of 2 rows, one pair a row), and a
    file of exactly those 4 pairs plus one longer than a row."""
    root = tmp_path_factory.mktemp("pairs")
    pairs = reverse_pairs(10, seed=4)
    path = write_jsonl(root / "pairs.jsonl", pairs)
    data = DataConfig(
        sources=(DataSource(name="pairs", kind="preference", path=str(path)),), held_out_fraction=0.3
    )
    held = tokenized_documents(data, "held_out", BYTE)[0].documents
    encoder = PreferenceEncoder(ChatEncoder(BYTE, find_chat_template("byte")))
    held_pairs = [
        p for p in pairs if any(np.array_equal(encoder.encode(p), held[i]) for i in range(len(held)))
    ]
    assert len(held_pairs) == 4
    run = root / "run"
    args = [
        "train", "dpo", *MINI, f"run.dir={run}", "--no-progress", "model.vocab_size=264",
        f"data.sources=[{{name: pairs, kind: preference, path: {path}}}]", "data.held_out_fraction=0.3",
        "train.seq_len=128", "eval.batches=2", "train.steps=2", "optim.warmup_steps=1",
    ]  # fmt: skip
    assert main(args) == 0
    return run, write_jsonl(root / "held_out.jsonl", [*held_pairs, TOO_LONG]), len(held_pairs)


def test_dpo_scores_the_held_out_pairs_file_as_its_held_out_evaluation(dpo_run, capsys):
    run, held, n = dpo_run
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert main(["eval", str(run), "--data", str(held), "--json"]) == 0
    out = capsys.readouterr()
    given = json.loads(out.out)
    assert list(given) == list(own) and own["pairs"] == given["pairs"] == n  # the long pair left out
    for key in own:
        assert given[key] == pytest.approx(own[key], rel=1e-5, abs=1e-6), key
    assert abs(own["chosen_reward"]) > 1e-3 and own["loss"] != pytest.approx(np.log(2), abs=1e-4)  # trained
    assert (
        "by the run's dpo loss (step 2), against reference log-probabilities of its starting weights"
        in out.err
    )
    assert "left out as longer than a row of 128 tokens: 1 pair of" in out.err


def test_a_run_without_its_config_yaml_is_still_evaluated_with_its_reference(dpo_run, tmp_path, capsys):
    """The run directory is the one holding checkpoints/, config.yaml or not (the checkpoint holds
    its config): its reference/ is found, not looked for two directories up."""
    run, _, _ = dpo_run
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "config.yaml").unlink()
    assert main(["eval", str(copy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == pytest.approx(own)


def test_simpo_scores_pairs_without_a_reference(dpo_run):
    """The simpo spec on the same weights: no starting weights are given (SavedRun's default), so
    a reference pass would fail; the file's metrics equal simpo's held-out evaluation."""
    run, held, n = dpo_run
    lm = zaya_jax.load(run)
    cfg = lm.run_config
    simpo = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="simpo"))
    expected = evaluate_held_out(lm, simpo, tokenizer=lm.tokenizer)
    saved = SavedRun(lm, simpo, run, lm.step, lm.tokenizer)
    source = DataSource(name=str(held), kind="preference", path=str(held))
    result = spec_for("simpo").evaluate_data(saved, GivenData((source,)))
    assert result.pop("evaluated").startswith(
        f"{held}: preference pairs scored by the run's simpo loss (step 2), in"
    )
    assert list(result) == list(expected) and result["pairs"] == n
    for key in expected:
        assert result[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    with pytest.raises(ValueError, match="none were given"):  # dpo would need the starting weights
        spec_for("dpo").evaluate_data(saved, GivenData((source,)))


def _one_line_error(capsys, args) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_references_from_other_starting_weights_are_refused(dpo_run, tmp_path, capsys):
    """The saved run config changed to another seed (another initialisation), then to a train.init_from
    that is gone, then the run's events.jsonl (the recorded fingerprint) removed: one line each."""
    run, held, _ = dpo_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    saved_config = copy / "checkpoints" / "2" / "config" / "metadata"
    config = json.loads(saved_config.read_text())
    for change, expected in (
        ({"seed": 7}, "(the initialisation of train.seed=7) are not the ones they were computed from"),
        ({"init_from": str(tmp_path / "gone")}, f"({tmp_path / 'gone'}) cannot be read"),
    ):
        saved_config.write_text(json.dumps({**config, "train": {**config["train"], **change}}))
        err = _one_line_error(capsys, ["eval", str(copy), "--data", str(held)])
        assert expected in err and "evaluate the run directory itself" in err
    (copy / "events.jsonl").unlink()
    assert "records no fingerprint" in _one_line_error(capsys, ["eval", str(copy), "--data", str(held)])


def test_a_preference_run_refuses_what_it_cannot_score(dpo_run, tmp_path, capsys):
    run = dpo_run[0]
    text = tmp_path / "notes.txt"
    text.write_text("plain text\n")
    assert "notes.txt: not JSONL" in _one_line_error(capsys, ["eval", str(run), "--data", str(text)])
    bad = write_jsonl(tmp_path / "bad.jsonl", [*reverse_pairs(1), {"text": "not a pair"}])
    assert "bad.jsonl:2: no prompt" in _one_line_error(capsys, ["eval", str(run), "--data", str(bad)])
    long = write_jsonl(tmp_path / "long.jsonl", [TOO_LONG] * 3)
    err = _one_line_error(capsys, ["eval", str(run), "--data", str(long)])
    assert "no pair of" in err and "fits a row of 128 tokens" in err and "raise --seq-len" in err
    assert "shape --data" in _one_line_error(capsys, ["eval", str(run), "--seq-len", "64"])
