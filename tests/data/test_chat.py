"""Chat data: rendering and the assistant mask equal transformers' ``apply_chat_template``, bad
records are named, conversations are packed whole (never attending to each other) and cut after an
assistant turn, and a chat preparation reads back as it was encoded."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.data.corpora import CHATML, assert_valid_row, chat_tokenizer_dir, write_jsonl
from zaya_jax.config import DataConfig, DataSource
from zaya_jax.data import DataError, load_tokenizer, open_prepared, prepare, tokenized_documents
from zaya_jax.data.chat import ChatEncoder, ChatTemplate, find_chat_template, read_chat_documents
from zaya_jax.data.packing import packed_rows
from zaya_jax.data.preview import TRAINED_CLOSE, TRAINED_OPEN
from zaya_jax.data.tasks import exact_match, reverse_chats
from zaya_jax.data.tasks import write_jsonl as write_chats

CONVERSATION = [
    {"role": "system", "content": "You are brief. {{ not a template }}"},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "four"},
    {"role": "tool", "content": '{"result": 4}'},
    {"role": "user", "content": "Héllo wörld, say it back"},
    {"role": "assistant", "content": "héllo wörld"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return chat_tokenizer_dir(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_rendering_and_mask_equal_transformers_apply_chat_template(hf_dir, tools):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(hf_dir)).apply_chat_template(
        CONVERSATION, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    tokenizer = load_tokenizer(hf_dir)
    document = ChatEncoder(tokenizer, find_chat_template(str(hf_dir / "tokenizer.json"))).encode(
        {"messages": CONVERSATION, "tools": tools}
    )
    assert document[0].tolist() == list(reference["input_ids"])
    assert document[1].tolist() == list(reference["assistant_masks"])
    im_end = tokenizer._tok.token_to_id("<|im_end|>")
    assert (document[0][document[1] == 1] == im_end).sum() == 2  # each reply's end marker is trained
    assert tokenizer.decode(document[0][document[1] == 1]) == "four\nhéllo wörld\n"  # (specials not shown)


def test_without_generation_blocks_the_assistant_spans_come_from_rendered_prefixes(hf_dir):
    tokenizer = load_tokenizer(hf_dir)
    with_blocks = ChatEncoder(tokenizer, ChatTemplate(CHATML, "with blocks"))
    plain = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    by_prefixes = ChatEncoder(tokenizer, ChatTemplate(plain, "plain"))
    np.testing.assert_array_equal(
        by_prefixes.encode({"messages": CONVERSATION}), with_blocks.encode({"messages": CONVERSATION})
    )
    # A template that renders earlier turns differently from the last one cannot be split by prefixes.
    rewriting = plain.replace(
        "{{ message['content'] }}<|im_end|>", "{{ message['content'] if loop.last else '' }}<|im_end|>"
    )
    with pytest.raises(ValueError, match=r"messages\[:3\] as a prefix.*\{% generation %\}"):
        ChatEncoder(tokenizer, ChatTemplate(rewriting, "rewriting")).encode({"messages": CONVERSATION})


def test_template_lookup_order_and_a_missing_template(tmp_path, hf_dir):
    assert "generation" in find_chat_template("byte").source
    assert find_chat_template(str(hf_dir / "tokenizer.json")).origin.endswith(
        "tokenizer_config.json (chat_template)"
    )
    beside = chat_tokenizer_dir(tmp_path / "beside")
    (beside / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert find_chat_template(str(beside / "tokenizer.json")).origin == str(beside / "chat_template.jinja")
    given = tmp_path / "mine.jinja"
    given.write_text(CHATML)
    assert find_chat_template(str(beside / "tokenizer.json"), str(given)).source == CHATML
    bare = chat_tokenizer_dir(tmp_path / "bare", template=None)
    with pytest.raises(DataError, match=r"has no chat template.*--chat-template FILE"):
        find_chat_template(str(bare / "tokenizer.json"))
    with pytest.raises(DataError, match="does not compile"):
        ChatEncoder(load_tokenizer("byte"), ChatTemplate("{% for %}", "broken"))


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"text": "hi"}, "no non-empty 'messages' list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "list content, not a string"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
    ],
)
def test_a_bad_record_is_named_with_its_line_or_skipped_and_counted(tmp_path, record, problem):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_chats(tmp_path / "chats.jsonl", [good, record, good])
    source = DataSource(name="chat", kind="chat", path=str(path))
    with pytest.raises(DataError, match=rf"chats.jsonl:2: .*{problem}.*on_bad_document=skip"):
        read_chat_documents(source, load_tokenizer("byte"), "error")
    skipped = read_chat_documents(source, load_tokenizer("byte"), "skip")
    assert skipped.skipped == 1 and skipped.keys == ["chats.jsonl:1", "chats.jsonl:3"]


def test_an_assistant_tool_call_without_content_renders(tmp_path):
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}],
    }
    record = {
        "messages": [{"role": "user", "content": "add"}, call, {"role": "tool", "content": "4"}],
        "tools": TOOLS,
    }
    tokenizer = load_tokenizer("byte")
    document = ChatEncoder(tokenizer, find_chat_template("byte")).encode(record)
    assert tokenizer.decode(document[0][document[1] == 1]).startswith('<|tool_calls|>[{"function"')


def _chat_rows(documents, seq_len: int) -> list[dict[str, np.ndarray]]:
    return list(
        packed_rows(documents, seq_len=seq_len, eos_id=1, pad_id=0, seed=0, shuffle=False, repeat=False)
    )


def test_conversations_are_packed_whole_and_trained_on_assistant_tokens_only(tmp_path):
    records = reverse_chats(40, seed=3)
    data = DataConfig(
        sources=(DataSource(name="chat", kind="chat", path=str(write_chats(tmp_path / "c.jsonl", records))),)
    )
    (source,) = tokenized_documents(data, "all", load_tokenizer("byte"))
    rows = _chat_rows(source.documents, 96)
    tokenizer = load_tokenizer("byte")
    seen = []
    for row in rows:
        for segment in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
            at = row["segment_ids"] == segment
            text = tokenizer.decode(np.r_[row["inputs"][at][:1], row["targets"][at]])
            assert text.count("<|user|>") == 1  # one whole conversation per segment: never two
            trained = tokenizer.decode(row["targets"][at][row["loss_mask"][at] > 0])
            assert trained == text.split("<|assistant|>\n")[1]  # the reply, its end marker, then EOS
            seen.append(text)
        assert row["loss_mask"][row["segment_ids"] == 0].sum() == 0
    assert [t.split("\n")[1] for t in seen] == [r["messages"][0]["content"] + "<|end|>" for r in records]


def test_a_conversation_longer_than_a_row_is_cut_after_an_assistant_turn(tmp_path):
    turns = []
    for i in range(6):
        turns += [
            {"role": "user", "content": f"question {i} " * 3},
            {"role": "assistant", "content": f"answer {i} " * 3},
        ]
    tokenizer = load_tokenizer("byte")
    document = ChatEncoder(tokenizer, find_chat_template("byte")).encode({"messages": turns})
    rows = _chat_rows([document], 128)
    assert document.shape[1] > 128 and len(rows) > 1
    pieces = [tokenizer.decode(r["inputs"][r["segment_ids"] > 0]) for r in rows]
    assert "".join(pieces) == tokenizer.decode(document[0])  # nothing lost or repeated
    for piece in pieces[1:]:
        assert piece.startswith("<|user|>")  # each later piece starts after an assistant turn
    for row in rows:
        assert_valid_row({**row, "loss_mask": (row["segment_ids"] > 0).astype(np.float32)}, 128, 0)


def test_chat_preparation_reads_back_as_encoded_and_inspect_marks_the_trained_targets(tmp_path):
    path = write_chats(tmp_path / "c.jsonl", reverse_chats(12, seed=5))
    manifest = prepare([path], tmp_path / "prepared", num_shards=3)  # auto: records hold messages
    assert manifest["content"] == "chat" and manifest["inputs"][0]["kind"] == "chat"
    in_memory = read_chat_documents(
        DataSource(name="c", kind="chat", path=str(path)), load_tokenizer("byte"), "error"
    )
    prepared = open_prepared(tmp_path / "prepared")
    for i, document in enumerate(in_memory.documents):
        np.testing.assert_array_equal(prepared[i], document)
    cli = [
        sys.executable,
        "-m",
        "zaya_jax.cli",
        "inspect",
        str(tmp_path / "prepared"),
        "--rows",
        "2",
        "--seq-len",
        "64",
    ]
    shown = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
    reply = reverse_chats(12, seed=5)[0]["messages"][1]["content"]
    assert f"<|assistant|>\n{TRAINED_OPEN}{reply}<|end|>\n[EOS]{TRAINED_CLOSE}" in shown
    data = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, check=True).stdout)
    first = data["rows"][0]
    assert sum(first["loss_mask"]) == first["trained"] == len(reply) + len("<|end|>\n") + 1
    with pytest.raises(DataError, match="mix chat conversations"):
        prepare([path, write_jsonl(tmp_path / "t.jsonl", ["text"])], tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()


def test_the_reverse_task_scores_exact_matches():
    record = reverse_chats(1, seed=0)[0]
    prompt, answer = (m["content"] for m in record["messages"])
    assert answer == prompt.removeprefix("reverse: ")[::-1]
    assert exact_match(prompt, f" {answer}<|end|>\n") == 1.0 and exact_match(prompt, answer + "x") == 0.0


def test_example_chat_writes_the_task_and_never_overwrites(tmp_path):
    from zaya_jax.cli import main
    from zaya_jax.data.chat import check_record

    out = tmp_path / "chat.jsonl"
    assert main(["data", "example-chat", str(out), "--records", "50", "--seed", "3"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records == reverse_chats(50, seed=3)
    assert all(check_record(r) is None for r in records)
    before = out.read_bytes()
    assert main(["data", "example-chat", str(out)]) != 0
    assert out.read_bytes() == before
