"""``zaya eval``: loss/perplexity of a saved model on held-out or given text."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

import zaya_jax
from tests.fixtures import MINI
from zaya_jax.cli import main
from zaya_jax.data import ByteTokenizer, HFTokenizer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", *MINI, f"run.dir={path}", "train.steps=2", "--no-progress"]) == 0
    return path


def test_eval_reproduces_the_runs_own_eval_loss(run, capsys):
    trained = json.loads((run / "summary.json").read_text())["eval_loss"]
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["loss"] == pytest.approx(trained, rel=1e-6)
    assert sorted(json.loads(out.out)) == ["loss", "perplexity", "tokens"]  # --json keeps its keys
    assert "the run's held-out evaluation (step 2): 1 batches of 2 x 32 tokens" in out.err


def test_an_export_carries_the_tokenizer_its_chat_template_and_every_stop_and_evaluates_with_them(
    tmp_path, capsys
):
    """The export of a run trained with an HF tokenizer that has a chat template (ChatML) holds the
    tokenizer, its special tokens and the template (``apply_chat_template`` on the export renders
    as zaya renders), and lists in ``eos_token_id`` every id the run's sampling stopped on: the
    model's EOS joined with ``model.eos_token_ids`` (not replaced by it), the tokenizer's EOS and the
    template's end of turn; ``zaya eval`` of the export reads with its tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    from tests.data.corpora import CHATML, chat_tokenizer_dir, small_corpus_override
    from zaya_jax.data.chat import ChatEncoder, ChatTemplate

    bpe = chat_tokenizer_dir(tmp_path / "tok") / "tokenizer.json"
    source = tmp_path / "run"
    args = [
        "train",
        *MINI,
        "model.vocab_size=400",
        "model.eos_token_ids=[7]",
        f"data.tokenizer={bpe}",
        small_corpus_override(tmp_path),
        f"run.dir={source}",
        "train.steps=1",
    ]
    assert main([*args, "--no-progress"]) == 0
    hf = tmp_path / "hf"
    assert main(["convert", "zaya-to-hf", str(source), str(hf)]) == 0  # the export carries the tokenizer
    assert (hf / "tokenizer.json").read_bytes() == bpe.read_bytes()
    saved = json.loads((hf / "tokenizer_config.json").read_text())
    assert saved["eos_token"] == "</s>" and saved["chat_template"] == CHATML

    ours = HFTokenizer(bpe)
    stops = {
        1,
        7,
        ours.eos_id,
        ours._tok.token_to_id("<|im_end|>"),
    }  # model EOS, extra stop, tokenizer's, turn end
    generation = json.loads((hf / "generation_config.json").read_text())["eos_token_id"]
    assert set(generation) == stops == set(json.loads((hf / "config.json").read_text())["eos_token_id"])
    assert GenerationConfig.from_pretrained(hf).eos_token_id == generation
    assert set(zaya_jax.load(hf).stop_token_ids) == stops

    theirs = AutoTokenizer.from_pretrained(hf)
    assert theirs.encode("hello world") == ours.encode("hello world").tolist()
    messages = [{"role": "user", "content": "what is two plus two"}]
    rendered = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ChatEncoder(ours, ChatTemplate(CHATML, "test")).prompt(messages)
    assert rendered.endswith("<|im_start|>assistant\n")

    capsys.readouterr()
    losses = {}
    for name, extra in {
        "default": [],
        "explicit": ["--tokenizer", str(bpe)],
        "byte": ["--tokenizer", "byte"],
    }.items():
        data = ["--data", str(tmp_path / "small_corpus.jsonl")]
        assert main(["eval", str(hf), *data, "--batches", "2", "--seq-len", "32", "--json", *extra]) == 0
        losses[name] = json.loads(capsys.readouterr().out)
    assert losses["default"] == losses["explicit"]  # the directory's tokenizer.json, not the byte tokenizer
    assert losses["default"]["loss"] != losses["byte"]["loss"]

    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": {"content": "<s>"}}))
    assert zaya_jax.load(hf).tokenizer.eos_id == 2  # the special tokens tokenizer_config.json names

    (hf / "tokenizer.json").unlink()
    assert main(["eval", str(hf), "--json"]) == 2  # no tokenizer: refused, not a silent byte-level loss
    assert "--tokenizer" in capsys.readouterr().err


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


def test_loading_from_python_uses_the_compilation_cache_as_the_command_does(run):
    """``zaya_jax.load`` (and so ``evaluate_path`` and ``generate`` from Python) switches the default
    persistent compilation cache on, as ``zaya eval`` and ``zaya generate`` do."""
    from zaya_jax.parallel.distributed import compilation_cache_path

    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        zaya_jax.load(run)
        assert jax.config.jax_compilation_cache_dir == str(compilation_cache_path("auto"))
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_eval_data_of_preference_pairs_is_refused_not_read_as_text(run, tmp_path, capsys):
    from zaya_jax.data.tasks import reverse_pairs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in reverse_pairs(3)))
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(pairs)]) == 2
    err = capsys.readouterr().err
    assert "hold preference pairs, which a dpo/ipo/simpo run scores by its loss" in err
    assert "--data of this lm run scores text" in err and len(err.strip().splitlines()) == 1
    assert main(["data", "prepare", str(pairs), "--out", str(tmp_path / "prepared")]) == 2
    assert "are not prepared" in capsys.readouterr().err and not (tmp_path / "prepared").exists()
