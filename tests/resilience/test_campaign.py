"""The CI subset of the randomized SIGKILL fault campaign (tests/resilience/campaign.py; the full
campaign is bench/fault_campaign.py): one training run killed three times at seeded moments inside
its steps and saves, then resumed to the end, bit-identical to the uninterrupted run with no committed
checkpoint lost; two killed ``zaya data prepare`` runs and one killed ``zaya convert`` each way, each
leaving no half-written output and rerunning to a byte-identical result. Train runs beside the
others (two children at a time)."""

from __future__ import annotations

from tests.resilience.campaign import plan_train, run_campaign, table

SEED = 7  # its train kills are all aimed inside the steps (anchors 6, 10, 3), none at start-up


def test_seeded_fault_campaign_subset(tmp_path):
    assert all(kill.anchor > 0 for kill in plan_train(SEED, 3, 12))
    tallies = run_campaign(
        tmp_path,
        seed=SEED,
        train_kills=3,
        kills_per_trial=3,
        prepare_kills=2,
        convert_kills=1,
        corpus_documents=8_000,
        parallel=True,
        log=lambda line: None,
    )
    report = table(tallies) + "\n" + "\n".join(f for t in tallies for f in t.failures)
    assert all(t.ok for t in tallies), report
    train = tallies[0]
    assert train.target == "zaya train" and train.faults >= 2 and train.lost == 0, report
    assert sum(t.faults for t in tallies[1:]) >= 3, report
