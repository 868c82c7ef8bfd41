"""The long-context checks: passkey prompts of exact length with the key where it was asked for,
their scoring (equal to what greedy decoding writes), the ``passkey`` data source, and the
held-out loss by position (equal in total to ``zaya eval``'s loss)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.random_model import random_variables, tiny_config
from zaya_jax.config import DataConfig, DataSource
from zaya_jax.data import ByteTokenizer, HFTokenizer, make_row_iterator
from zaya_jax.data.passkey import INTRO, QUESTION, needle, passkey_documents, passkey_prompt, passkey_text
from zaya_jax.eval import evaluate
from zaya_jax.eval.long_context import answered, loss_by_position, passkey_accuracy
from zaya_jax.lm import LanguageModel

BYTES = ByteTokenizer()


@pytest.fixture(scope="module")
def lm() -> LanguageModel:
    cfg = tiny_config(vocab_size=264, max_position_embeddings=512, eos_token_id=1)
    return LanguageModel(cfg, random_variables(cfg, 3), tokenizer=BYTES)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_a_passkey_prompt_has_the_length_asked_and_hides_the_key_at_its_depth(depth):
    ids, answer = passkey_prompt(BYTES, 300, depth, "48213")
    text = BYTES.decode(ids)
    assert len(ids) == 300 and answer == 5 and text.endswith(QUESTION + "48213")
    filler = 300 - len(INTRO) - len(needle("48213")) - len(QUESTION) - 5
    assert text.index(needle("48213")) == len(INTRO) + round(depth * filler)
    # with the byte tokenizer the prompt is the source's document format, byte for byte
    assert text + "." == passkey_text(301, depth, "48213")


def test_a_passkey_prompt_has_its_length_with_a_bpe_tokenizer_and_refuses_a_length_too_short(tmp_path):
    from tests.data.corpora import chat_tokenizer_dir

    bpe = HFTokenizer(chat_tokenizer_dir(tmp_path) / "tokenizer.json")
    ids, answer = passkey_prompt(bpe, 257, 0.5, "90817")
    assert len(ids) == 257 and bpe.decode(ids[-answer:]).strip() == "90817"
    with pytest.raises(ValueError, match="needs at least"):
        passkey_prompt(BYTES, 40, 0.5, "90817")


def test_a_check_passes_exactly_when_greedy_decoding_writes_the_answer(lm):
    prefix = BYTES.encode(
        "Remember the pass key.\nThe grass is green. What is the pass key? The pass key is "
    )
    greedy = np.asarray(lm.generate([prefix.tolist()], max_new_tokens=5, stop_tokens=[]).tokens[0][:5])
    wrong_last, wrong_first = greedy.copy(), greedy.copy()
    wrong_last[-1] = (wrong_last[-1] + 1) % 256 + 3
    wrong_first[0] = (wrong_first[0] + 1) % 256 + 3
    checks = [(np.concatenate([prefix, a]).astype(np.int32), 5) for a in (greedy, wrong_last, wrong_first)]
    assert answered(lm, checks, batch_size=2) == [True, False, False]
    # a shorter answer of the same length of check: only its own tokens count
    assert answered(lm, [(checks[0][0], 3), (checks[1][0], 5)]) == [True, False]


def test_passkey_accuracy_reports_each_depth(lm):
    result = passkey_accuracy(lm, BYTES, 160, depths=(0.0, 1.0), prompts=3, batch_size=4)
    assert result["length"] == 160 and result["checks"] == 6 and set(result["by_depth"]) == {"0", "1"}
    assert result["accuracy"] == pytest.approx(np.mean(list(result["by_depth"].values())))
    with pytest.raises(ValueError, match=r"fractions of the filler in \[0, 1\]"):
        passkey_accuracy(lm, BYTES, 160, depths=(1.5,))


def test_the_passkey_source_is_deterministic_and_splits_held_out_documents():
    first = list(passkey_documents(50))
    assert first == list(passkey_documents(50)) and len({text for _, text in first}) == 50
    assert all(QUESTION in text and text.endswith(".") for _, text in first)
    data = DataConfig(sources=(DataSource(name="pk", kind="passkey"),))
    rows = {
        split: next(
            make_row_iterator(data, BYTES, seq_len=64, seed=0, split=split, shuffle=False, repeat=False)
        )
        for split in ("train", "held_out")
    }
    assert not np.array_equal(rows["train"]["inputs"], rows["held_out"]["inputs"])


def test_loss_by_position_adds_up_to_the_held_out_loss(lm):
    data = DataConfig(sources=(DataSource(name="pk", kind="passkey"),))
    shape = {"seq_len": 64, "batch_size": 2, "max_batches": 3}
    result = loss_by_position(lm, data, buckets=4, tokenizer=BYTES, **shape)
    whole = evaluate(lm, data, tokenizer=BYTES, **shape)
    assert result["tokens"] == whole["tokens"] == sum(b["tokens"] for b in result["by_position"])
    assert result["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert [(b["from"], b["to"]) for b in result["by_position"]] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    with pytest.raises(ValueError, match="1 to seq_len=64 buckets"):
        loss_by_position(lm, data, buckets=65, tokenizer=BYTES, **shape)


def test_zaya_eval_runs_the_long_context_checks(tmp_path, capsys):
    from tests.fixtures import MINI
    from zaya_jax.cli import main

    run = tmp_path / "run"
    assert main(["train", *MINI, f"run.dir={run}", "train.steps=1", "--no-progress"]) == 0
    capsys.readouterr()
    args = [
        "eval",
        str(run),
        "--passkey",
        "128",
        "--passkey-prompts",
        "1",
        "--by-position",
        "2",
        "--seq-len",
        "32",
    ]
    assert main([*args, "--batches", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 1 and result["passkey"][0]["checks"] == 5
    assert len(result["loss"]["by_position"]) == 2
