"""A prepared shard removed, truncated or replaced while it is being read: a DataError naming the
shard and the fix, never an empty or wrong document (an open ArrayRecord reader keeps reading a
removed file and returns empty records from a truncated one), and a training run stopped by it
leaves every checkpoint restorable and resumes once the file is back."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.data.corpora import write_jsonl
from zaya_jax.config import DataConfig, DataSource
from zaya_jax.data import ByteTokenizer, DataError, make_row_iterator, next_batch, open_prepared, prepare
from zaya_jax.data.prepared.format import shard_name

TEXTS = [f"document number {i}: " + "abcdefghij"[: i % 10] * 3 for i in range(400)]
SHARD = shard_name(1, 2)


@pytest.fixture
def prepared(tmp_path):
    out = tmp_path / "prepared"
    prepare([write_jsonl(tmp_path / "corpus.jsonl", TEXTS)], out, num_shards=2)
    return out


def _damage(path: Path, how: str) -> None:
    if how == "removed":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, path.stat().st_size // 3)
    elif how == "replaced":  # same size, other bytes, renamed over it (as a copy tool does)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tmp = path.with_name(path.name + ".new")
        tmp.write_bytes(bytes(data))
        os.replace(tmp, path)


@pytest.mark.parametrize("how", ["removed", "truncated", "replaced"])
def test_a_shard_damaged_after_opening_is_an_error_naming_it(prepared, how):
    docs = open_prepared(prepared, ByteTokenizer())
    tok = ByteTokenizer()
    assert tok.decode(docs[1]) == TEXTS[1]
    _damage(prepared / SHARD, how)
    assert tok.decode(docs[0]) == TEXTS[0]  # the other shard is fine
    with pytest.raises(DataError, match=rf"shard {prepared / SHARD} was {how}.*zaya data prepare"):
        docs[3]


@pytest.mark.parametrize("how", ["removed", "truncated"])
def test_the_pipeline_stops_with_the_error_instead_of_empty_documents(prepared, how):
    cfg = DataConfig(
        sources=(DataSource(name="p", kind="arrayrecord", path=str(prepared)),), shuffle_window=8
    )
    rows = make_row_iterator(cfg, ByteTokenizer(), seq_len=32, seed=0)
    for _ in range(3):
        next_batch(rows, 4)
    _damage(prepared / SHARD, how)
    with pytest.raises(DataError, match=rf"shard {prepared / SHARD} was {how}"):
        for _ in range(50):
            next_batch(rows, 4)


def test_a_shard_truncated_during_training_stops_the_run_and_every_checkpoint_restores(
    prepared, tmp_path, capsys
):
    from tests.fixtures import MINI
    from zaya_jax.checkpoint import restore_model
    from zaya_jax.cli import main
    from zaya_jax.train.hooks import Hook

    run = tmp_path / "run"
    backup = tmp_path / "backup"
    shutil.copy2(prepared / SHARD, backup)
    source = f"data.sources=[{{name: p, kind: arrayrecord, path: {prepared}}}]"
    args = ["train", *MINI, source, "data.shuffle_window=8", "train.steps=12", "optim.warmup_steps=2"]
    args += ["eval.every=100", "checkpoint.every_steps=2", f"run.dir={run}", "--no-progress"]

    class TruncateAfterStep4(Hook):  # the file operation lands at a step, not at a moment
        def after_step(self, end):
            if end.step == 4:
                os.truncate(prepared / SHARD, 100)

    assert main(args, hooks=[TruncateAfterStep4()]) == 2
    err = capsys.readouterr().err
    assert f"zaya train: shard {prepared / SHARD} was truncated" in err and "zaya data prepare" in err
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and max(steps) < 12
    for step in steps:  # every checkpoint left behind is complete and readable
        _, variables, restored = restore_model(run / "checkpoints" / str(step))
        assert restored == step
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(variables["params"]))
    # the file restored, the same command resumes from the last checkpoint and finishes
    shutil.copy2(backup, prepared / SHARD)
    capsys.readouterr()
    assert main(args) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["detail"]["from_step"] for e in events if e["event"] == "resume"] == [max(steps)]
