"""`zaya data prepare` over worker processes and hosts writes the bytes one process writes, and a
preparation stopped part way redoes only its unfinished units and shards."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time

import pytest

from tests.data.corpora import write_jsonl, write_parquet
from zaya_jax.cli.data import hosts
from zaya_jax.data import DataError, prepare
from zaya_jax.data.prepared.work import READER_THREAD, _prefetched

ROWS = [f"row {i}: " + "lorem ipsum dolor " * (i % 9) for i in range(400)]


def _inputs(tmp_path):
    src = tmp_path / "src"
    (src / "docs").mkdir(parents=True)
    for i in range(3):
        (src / "docs" / f"{i}.txt").write_text(f"text file {i} " * (i + 1))
    big = write_jsonl(src / "big.jsonl", ROWS)  # ~37 KB: 18 units of 2 KB
    with big.open("a") as f:
        f.write("not json\n")  # a bad line in a later unit: its line number must be the global one
    return [src / "docs", big, write_parquet(src / "table.parquet", ["pq a", "pq b"])]


def _files(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture
def reference(tmp_path):
    """One process, one unit per file: the bytes every split must reproduce."""
    inputs = _inputs(tmp_path)
    out = tmp_path / "reference"
    manifest = prepare(inputs, out, num_shards=3, on_bad_document="skip")
    assert manifest["skipped_documents"] == 1 and manifest["inputs"][1]["problems"][0].endswith(
        "big.jsonl:401: not valid JSON (Expecting value)"
    )
    return inputs, _files(out)


def test_units_and_workers_write_the_bytes_of_one_process(tmp_path, reference):
    inputs, expected = reference
    out = tmp_path / "two_workers"
    prepare(inputs, out, num_shards=3, on_bad_document="skip", workers=2, unit_bytes=2048)
    assert _files(out) == expected
    assert not [p.name for p in tmp_path.iterdir() if ".work-" in p.name]  # the work is cleaned up


def test_two_hosts_write_the_bytes_of_one_process(tmp_path, reference):
    inputs, expected = reference
    out = tmp_path / "two_hosts"
    command = [sys.executable, "-m", "zaya_jax.cli", "data", "prepare", *map(str, inputs), "--out", str(out)]
    command += [
        "--shards",
        "3",
        "--on-bad-document",
        "skip",
        "--unit-mb",
        str(2048 / 2**20),
        "--num-hosts",
        "2",
    ]
    procs = {
        h: subprocess.Popen(
            [*command, "--host-index", str(h)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for h in (1, 0)
    }
    errors = {}
    for h, proc in procs.items():  # host 0 waits for host 1's units, then writes every shard
        _, errors[h] = proc.communicate(timeout=300)
        assert proc.returncode == 0, errors[h]
    assert "host 1: 11/11 units" in errors[1] and "host 0: 22/22 units of all hosts" in errors[0]
    assert "host 0: 3/3 shards" in errors[0] and "shards" not in errors[1]
    assert _files(out) == expected


def test_a_stopped_preparation_redoes_only_unfinished_work(tmp_path, reference):
    inputs, expected = reference
    out = tmp_path / "stopped"
    kwargs = {"num_shards": 3, "on_bad_document": "skip", "unit_bytes": 2048}

    def stop_after(what, count):
        def progress(kind, done, total):
            if kind == what and done == count:
                raise KeyboardInterrupt  # a kill: nothing is cleaned up

        return progress

    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, out, progress=stop_after("units", 4), **kwargs)
    (work,) = tmp_path.glob(".stopped.work-*")
    done = {p.name: p.stat().st_mtime_ns for p in (work / "pieces").glob("*.json")}
    assert len(done) == 4 and not out.exists()
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, out, progress=stop_after("shards", 1), **kwargs)
    assert {p.name: p.stat().st_mtime_ns for p in (work / "pieces").glob("*.json")} | done == {
        p.name: p.stat().st_mtime_ns for p in (work / "pieces").glob("*.json")
    }  # the first four pieces were not redone
    shard = {p.name: p.stat().st_mtime_ns for p in (work / "shards").glob("*.json")}
    assert len(shard) == 1
    seen = []
    prepare(inputs, out, progress=lambda kind, done, total: seen.append((kind, done, total)), **kwargs)
    assert _files(out) == expected
    assert ("units", 22, 22) in seen and ("shards", 3, 3) in seen  # skipped work is counted as done
    assert not work.exists()


def test_a_changed_input_starts_the_work_again(tmp_path):
    inputs = _inputs(tmp_path)
    out = tmp_path / "changed"

    def stop(kind, done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, out, num_shards=3, on_bad_document="skip", unit_bytes=2048, progress=stop)
    (stale,) = tmp_path.glob(".changed.work-*")
    (inputs[0] / "0.txt").write_text("changed text")
    manifest = prepare(inputs, out, num_shards=3, on_bad_document="skip", unit_bytes=2048)
    assert manifest["documents"] == 3 + 400 + 2 and not stale.exists()


def test_hosts_come_from_the_flags_or_an_srun_step():
    step = {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}
    assert hosts(None, None, {}) == (1, 0)
    assert hosts(None, None, step) == (4, 2)
    assert hosts(2, 1, step) == (2, 1)
    assert hosts(None, None, {"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}) == (1, 0)  # sbatch's shell, no step
    with pytest.raises(DataError, match=r"host_index=2 must be in \[0, num_hosts=2\)"):
        prepare(["x"], "y", num_hosts=2, host_index=2)


def test_the_reader_thread_stops_with_its_consumer_and_hands_on_errors():
    produced = []

    def items(fail_at=None):
        for i in range(1000):
            if i == fail_at:
                raise DataError(f"bad document {i}")
            produced.append(i)
            yield i

    reader = _prefetched(items(), depth=2)
    assert [next(reader), next(reader)] == [0, 1]
    reader.close()  # the consumer stops early (an error while writing a piece)
    for _ in range(200):  # the thread notices within a poll of 0.1 s
        if not any(t.name == READER_THREAD for t in threading.enumerate()):
            break
        time.sleep(0.05)
    assert not any(t.name == READER_THREAD for t in threading.enumerate())
    assert len(produced) <= 6  # it stopped reading, two ahead at most
    with pytest.raises(DataError, match="bad document 3"):
        list(_prefetched(items(fail_at=3)))
