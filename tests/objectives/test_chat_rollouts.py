"""Rollouts of a chat model stop at its template's end of turn by default (the tokenizer's EOS, the
EOS list of ``generation_config.json`` and the template's turn end, not only ``model.eos_token_ids``),
and the reward receives the completion as the template renders it (special tokens kept)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.data.corpora import chat_tokenizer_dir
from zaya_jax.config import load_config
from zaya_jax.data import load_tokenizer
from zaya_jax.data.chat import BYTE_CHAT_TEMPLATE, ChatEncoder, ChatTemplate
from zaya_jax.data.tasks import reverse_reward, sort_chats, sort_reward
from zaya_jax.generate import Generation
from zaya_jax.objectives import rewards
from zaya_jax.objectives.rewards import completion_texts, held_out_reward, rollout_stop_ids

RECORD = {"messages": [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """ChatML: a turn ends with ``<|im_end|>``, the EOS is ``</s>``."""
    directory = chat_tokenizer_dir(tmp_path_factory.mktemp("chatml"))
    return load_tokenizer(directory)


def _ids(tokenizer, *names):
    return [tokenizer._tok.token_to_id(n) for n in names]


def test_the_stop_ids_hold_the_templates_turn_end_and_the_eos(chatml):
    im_end, eos = _ids(chatml, "<|im_end|>", "</s>")
    assert im_end != eos and chatml.eos_id == eos
    cfg = load_config("grpo")
    assert ChatEncoder(chatml, rewards.tokenizer_chat_template(chatml)).turn_end_ids() == (im_end,)
    assert set(rollout_stop_ids(cfg, chatml)) == {cfg.model.eos_token_id, eos, im_end}
    # a template whose turn ends in plain text (the byte template's "<|end|>" bytes) has no turn-end id
    byte = load_tokenizer("byte")
    assert ChatEncoder(byte, ChatTemplate(BYTE_CHAT_TEMPLATE, "byte")).turn_end_ids() == ()
    assert rollout_stop_ids(cfg, byte) == (byte.eos_id,)


def test_the_generation_configs_eos_list_is_a_stop(tmp_path):
    directory = chat_tokenizer_dir(tmp_path / "tok")
    tokenizer = load_tokenizer(directory)
    start, pad = _ids(tokenizer, "<|im_start|>", "<pad>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [start, pad]}))
    assert {start, pad} <= set(rollout_stop_ids(load_config("grpo"), tokenizer))


def test_the_reward_sees_the_completion_as_the_template_renders_it(chatml):
    im_end, eos = _ids(chatml, "<|im_end|>", "</s>")
    rows = [[*chatml.encode("cba"), im_end], [*chatml.encode("cb")], [*chatml.encode("cba"), eos]]
    texts = completion_texts(chatml, rows)
    assert texts == ["cba<|im_end|>", "cb", "cba</s>"]
    assert [reverse_reward(RECORD, t) for t in texts] == [
        1.0,
        0.0,
        1.0,
    ]  # the built-in reward reads up to the turn end
    assert completion_texts(
        load_tokenizer("byte"), [[*load_tokenizer("byte").encode("cba<|end|>\n"), 1]]
    ) == ["cba<|end|>\n"]


def test_the_held_out_reward_samples_with_the_stop_ids_and_scores_the_rendered_text(chatml, monkeypatch):
    im_end = chatml._tok.token_to_id("<|im_end|>")
    answer = [*chatml.encode("cba"), im_end]
    seen = {}

    def fake_generate(cfg, variables, ids, **kwargs):
        seen.update(kwargs)
        tokens = np.asarray([answer + [0] * (kwargs["max_new_tokens"] - len(answer))], np.int32)
        n = np.asarray([len(answer)], np.int32)
        return Generation(tokens, n, np.ones(1, bool))

    monkeypatch.setattr(rewards, "generate", fake_generate)
    texts = []
    reward = held_out_reward(
        load_config("grpo"), {}, chatml, [RECORD], lambda r, t: texts.append(t) or reverse_reward(r, t)
    )
    assert im_end in seen["stop_tokens"] and reward == 1.0 and texts == ["cba<|im_end|>"]


def test_the_sort_task_gives_partial_credit_up_to_the_end_of_turn():
    record = sort_chats(1, seed=3)[0]
    answer = record["messages"][1]["content"]
    assert answer == "".join(sorted(record["messages"][0]["content"].removeprefix("sort: ")))
    assert sort_reward(record, answer + "<|im_end|>") == 1.0
    assert sort_reward(record, answer[:-1] + "<|im_end|>") == pytest.approx(1 - 1 / len(answer))
    assert sort_reward(record, answer + "\nuser\nsort: ab") < 0.5  # cut off: what follows costs credit
    with pytest.raises(ValueError, match="not a sort-task prompt"):
        sort_reward(RECORD, "abc")
