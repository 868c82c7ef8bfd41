"""The CI subset of the randomized SIGKILL fault campaign (bench/campaigns/sigkill.py; the full
campaign is bench/fault_campaign.py): one training run killed twice at seeded moments inside
its steps and saves, then resumed to the end, bit-identical to the uninterrupted run with no committed
checkpoint lost; one killed ``zaya data prepare`` run and one killed ``zaya convert`` each way, each
leaving no half-written output and rerunning to a byte-identical result. Train runs beside the
others (two children at a time)."""

from __future__ import annotations

import itertools
import shutil

from bench.campaigns.sigkill import (
    Tally,
    TrainReference,
    check_latest,
    plan_train,
    run_campaign,
    same_files,
    table,
)

SEED = 7  # its train kills are both aimed inside the steps (anchors 6, 10), none at start-up


def test_seeded_fault_campaign_subset(tmp_path):
    assert all(kill.anchor > 0 for kill in itertools.islice(plan_train(SEED, 12), 2))
    tallies = run_campaign(
        tmp_path,
        seed=SEED,
        train_kills=2,
        kills_per_trial=2,
        prepare_kills=1,
        convert_kills=1,
        corpus_documents=8_000,
        parallel=True,
        log=lambda line: None,
    )
    report = table(tallies) + "\n" + "\n".join(f for t in tallies for f in t.failures)
    assert all(t.ok for t in tallies), report
    assert [t.faults for t in tallies] == [2, 1, 1, 1], report
    # The checks can fail: the reference's newest checkpoint, copied and then damaged, counts as lost.
    ref = TrainReference(tmp_path / "train" / "reference", 12, 1, 2, windows=[1.0] * 14)
    broken = tmp_path / "broken"
    shutil.copytree(ref.run, broken)
    params = broken / "checkpoints" / "12" / "params"
    for path in (p for p in params.rglob("*") if p.is_file() and p.stat().st_size):
        path.write_bytes(b"\xa5" * path.stat().st_size)
    tally = Tally("damaged copy")
    check_latest(ref, broken, 12, tally, "damaged copy")
    assert tally.lost == 1 and "cannot be restored" in tally.failures[0], tally.failures
    assert not same_files(ref.run, broken)
