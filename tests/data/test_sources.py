"""Reading documents: text, JSONL and Parquet sources, their order and keys, and bad data."""

from __future__ import annotations

import pathlib

import pytest

from tests.data.corpora import write_jsonl, write_parquet
from zaya_jax.config import DataSource
from zaya_jax.data import DataError, read_documents
from zaya_jax.data.sources import source_for_path


def text_source(path, **kw) -> DataSource:
    return DataSource(name="t", kind="text", path=str(path), **kw)


def test_text_directory_is_read_recursively_in_sorted_order_without_hidden_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zed")
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "c.md").write_text("")  # empty: no tokens, silently dropped
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    docs = read_documents(text_source(tmp_path))
    assert docs.keys == ["a.txt", "b/z.txt"]
    assert docs.texts == ["alpha", "zed"]
    assert docs.skipped == 0


def test_text_glob_keys_are_relative_to_the_glob_root(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "1.txt").write_text("one")
    (tmp_path / "x" / "2.py").write_text("two")
    (tmp_path / "3.txt").write_text("three")
    docs = read_documents(text_source(tmp_path / "**" / "*.txt"))
    assert docs.keys == ["3.txt", "x/1.txt"]
    with pytest.raises(DataError, match="matches no files"):
        read_documents(text_source(tmp_path / "*.nothing"))


def test_jsonl_documents_are_keyed_by_line_and_blank_lines_ignored(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "first"}\n\n{"text": "second", "id": 7}\n')
    docs = read_documents(DataSource(name="j", kind="jsonl", path=str(path)))
    assert docs.texts == ["first", "second"]
    assert docs.keys == ["d.jsonl:1", "d.jsonl:3"]


def test_jsonl_text_field_is_configurable(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["a", "b"], field="content")
    docs = read_documents(DataSource(name="j", kind="jsonl", path=str(path), text_field="content"))
    assert docs.texts == ["a", "b"]


def test_parquet_documents_come_from_the_text_column(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ["one", "two", "three"])
    docs = read_documents(DataSource(name="p", kind="parquet", path=str(path)))
    assert docs.texts == ["one", "two", "three"]
    assert docs.keys == ["d.parquet#0", "d.parquet#1", "d.parquet#2"]
    with pytest.raises(DataError, match=r"no column 'body'.*'text'"):
        read_documents(DataSource(name="p", kind="parquet", path=str(path), text_field="body"))


def test_parquet_null_text_is_a_bad_document(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ["one", None, "three"])
    with pytest.raises(DataError, match=r"d\.parquet row 1.*null"):
        read_documents(DataSource(name="p", kind="parquet", path=str(path)))
    docs = read_documents(DataSource(name="p", kind="parquet", path=str(path)), on_bad_document="skip")
    assert docs.texts == ["one", "three"] and docs.skipped == 1


def test_corrupt_parquet_file_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match=r"broken\.parquet"):
        read_documents(DataSource(name="p", kind="parquet", path=str(path)))


def test_undecodable_text_file_names_the_file_or_is_skipped_and_counted(tmp_path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt is not valid UTF-8.*on_bad_document=skip"):
        read_documents(text_source(tmp_path))
    docs = read_documents(text_source(tmp_path), on_bad_document="skip")
    assert docs.texts == ["fine"]
    assert docs.skipped == 1 and "latin1.txt" in docs.problems[0]


def test_unreadable_file_names_the_file_or_is_skipped(tmp_path, monkeypatch):
    (tmp_path / "good.txt").write_text("fine")
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    real_read_bytes = pathlib.Path.read_bytes

    def read_bytes(self):
        # chmod cannot lock a file for root (the CI container), so deny the read here.
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_bytes(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    with pytest.raises(
        DataError, match=r"cannot read .*locked\.txt \(Permission denied\); fix its permissions"
    ):
        read_documents(text_source(tmp_path))
    assert read_documents(text_source(tmp_path), on_bad_document="skip").skipped == 1


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_a_truncated_gz_source_is_named_as_truncated_not_as_a_permission_problem(tmp_path, kind):
    import gzip

    body = "".join(f'{{"text": "document {i} {"x" * 50}"}}\n' for i in range(200))
    data = gzip.compress(body.encode())
    path = tmp_path / ("d.txt.gz" if kind == "text" else "d.jsonl.gz")
    path.write_bytes(data[: len(data) // 2])
    source = DataSource(name="g", kind=kind, path=str(path))
    with pytest.raises(DataError, match=r"cannot read .*d\.(txt|jsonl)\.gz.*truncated or corrupt") as err:
        read_documents(source)
    assert "permissions" not in str(err.value)


def test_malformed_jsonl_lines_name_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken\n{"other": "x"}\n{"text": 5}\n[1, 2]\n')
    source = DataSource(name="j", kind="jsonl", path=str(path))
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON"):
        read_documents(source)
    docs = read_documents(source, on_bad_document="skip")
    assert docs.texts == ["ok"] and docs.skipped == 4
    assert "d.jsonl:3: no field 'text' (fields: 'other')" in docs.problems[1]
    assert "d.jsonl:4: field 'text' is a int, not a string" in docs.problems[2]
    assert "d.jsonl:5: a JSON list, not an object" in docs.problems[3]


def test_jsonl_line_with_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2 is not valid UTF-8"):
        read_documents(DataSource(name="j", kind="jsonl", path=str(path)))


def test_a_source_without_documents_is_an_error_even_when_skipping(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="has no documents: the files hold no text"):
        read_documents(text_source(tmp_path))
    path = tmp_path / "bad.jsonl"
    path.write_text("nope\n")
    with pytest.raises(DataError, match=r"all 1 bad documents were skipped.*bad\.jsonl:1"):
        read_documents(DataSource(name="j", kind="jsonl", path=str(path)), on_bad_document="skip")


def test_missing_path_is_named(tmp_path):
    with pytest.raises(DataError, match=r"absent\.jsonl does not exist"):
        read_documents(DataSource(name="j", kind="jsonl", path=str(tmp_path / "absent.jsonl")))


def test_prepare_inputs_pick_their_kind_by_extension():
    assert source_for_path("a/b.jsonl").kind == "jsonl"
    assert source_for_path("data/*.parquet").kind == "parquet"
    assert source_for_path("corpus/").kind == "text"
    assert source_for_path("notes.txt").kind == "text"
