"""The one durable atomic write, the events line writer and the sha256 helper."""

from __future__ import annotations

import hashlib
import json

import pytest

from zaya_jax.files import EVENTS, append_event, atomic_file, filter_jsonl, sha256_file, write_atomic


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
