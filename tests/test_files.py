"""The one durable atomic write, the events line writer and the sha256 helper."""

from __future__ import annotations

import hashlib
import json

import pytest

from zaya_jax.files import (
    EVENTS,
    InputFileError,
    append_event,
    atomic_file,
    filter_jsonl,
    read_json,
    sha256_file,
    write_atomic,
)


def test_an_atomic_write_replaces_the_file_or_leaves_it_as_it_was(tmp_path):
    path = tmp_path / "summary.json"
    write_atomic(path, "first")
    write_atomic(path, b"second")
    assert path.read_text() == "second"
    with pytest.raises(RuntimeError), atomic_file(path) as f:
        f.write("half a fi")
        raise RuntimeError("disk full")
    assert path.read_text() == "second"  # the old contents survive a failed write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temporary left


def test_filter_jsonl_keeps_matching_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    filter_jsonl(path, lambda record: record["step"] <= 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    filter_jsonl(tmp_path / "missing.jsonl", lambda record: True)  # nothing to filter: no error


def test_events_and_checksums(tmp_path):
    append_event(tmp_path / "run", "restart", None, {"attempt": 2})
    append_event(tmp_path / "run", "hang", 7, {"phase": "step"})
    lines = [json.loads(line) for line in (tmp_path / "run" / EVENTS).read_text().splitlines()]
    assert [(e["event"], e["step"], e["detail"]) for e in lines] == [
        ("restart", None, {"attempt": 2}),
        ("hang", 7, {"phase": "step"}),
    ]
    assert all(isinstance(e["time"], float) for e in lines)
    blob = bytes(range(256)) * 20000  # several read pieces
    (tmp_path / "blob").write_bytes(blob)
    assert sha256_file(tmp_path / "blob") == hashlib.sha256(blob).hexdigest()


def test_filter_jsonl_keeps_lines_it_cannot_judge(tmp_path):
    path = tmp_path / "metrics.jsonl"
    torn = b'{"step": 3, "lo'
    path.write_bytes(b'{"step": 1}\n{"step": 5}\n\xff\xfe garbage\n[1, 2]\n{"other": 1}\n' + torn)
    filter_jsonl(path, lambda record: record["step"] <= 2)
    assert path.read_bytes() == b'{"step": 1}\n\xff\xfe garbage\n[1, 2]\n{"other": 1}\n' + torn + b"\n"


def test_read_json_names_the_file_the_line_and_the_fix(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "a": 1,\n  oops\n}')
    with pytest.raises(InputFileError, match=rf"{path}:3: not valid JSON .* in the thing; fix it"):
        read_json(path, "the thing", "fix it")
    path.write_bytes(b"\x00\xff")
    with pytest.raises(InputFileError, match="not UTF-8 text"):
        read_json(path, "the thing")
    path.write_text("[1, 2]")
    with pytest.raises(InputFileError, match="holds a JSON list, not an object"):
        read_json(path, "the thing")
    assert read_json(path, "the thing", kind=list) == [1, 2]
    path.unlink()
    path.symlink_to(tmp_path / "gone")
    with pytest.raises(InputFileError, match=f"{path} \\(the thing\\) is a broken link"):
        read_json(path, "the thing")
