"""Preference tuning: pairs are read, named when bad, and packed whole (chosen and rejected as
adjacent segments, completions scored); a DPO run scores every pair once with its starting weights,
equal to HF ``ZayaForCausalLM`` on the completion tokens, starts at loss ln 2, keeps the reference
across a resume and refuses one whose data changed."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from tests.fixtures import MINI
from tests.hf_reference import make_hf_model, torch
from zaya_jax import objectives
from zaya_jax.cli import main
from zaya_jax.config import ConfigError, DataConfig, DataSource, load_config
from zaya_jax.data import DataError, load_tokenizer, make_row_iterator, tokenized_documents
from zaya_jax.data.chat import ChatEncoder, find_chat_template
from zaya_jax.data.preference import PreferenceEncoder
from zaya_jax.data.tasks import reverse_pairs
from zaya_jax.data.tasks import write_jsonl as write_records

BYTE = load_tokenizer("byte")
ENCODER = PreferenceEncoder(ChatEncoder(BYTE, find_chat_template("byte")))


def _data(path, **kwargs) -> DataConfig:
    return DataConfig(sources=(DataSource(name="pairs", kind="preference", path=str(path)),), **kwargs)


def test_pairs_are_packed_whole_with_only_the_completions_scored(tmp_path):
    pairs = reverse_pairs(6, seed=1)
    pairs[1] = {  # a conversation prompt with an earlier assistant turn: context, never scored
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "reverse: abc"},
        ],
        "chosen": {"role": "assistant", "content": "cba"},
        "rejected": [{"role": "assistant", "content": "abc"}],
    }
    pairs[4] = {"prompt": "reverse: " + "x" * 200, "chosen": "y" * 40, "rejected": "z"}  # longer than a row
    path = write_records(tmp_path / "pairs.jsonl", pairs)
    data = _data(path)
    rows = list(make_row_iterator(data, BYTE, seq_len=256, seed=0, split="all", shuffle=False, repeat=False))
    placed = []
    for row in rows:
        segments = row["segment_ids"]
        assert segments.max() % 2 == 0  # pairs only, whole
        for k in range(1, segments.max() + 1, 2):
            chosen, rejected = (row["targets"][(segments == s) & (row["loss_mask"] > 0)] for s in (k, k + 1))
            placed.append((BYTE.decode(chosen[:-1]), BYTE.decode(rejected[:-1])))  # the EOS target last
            assert row["targets"][segments == k][-1] == BYTE.eos_id
    expected = [(p["chosen"], p["rejected"]) for i, p in enumerate(pairs) if i not in (1, 4)]
    assert [c for c, _ in placed if c != "cba<|end|>\n"] == [c + "<|end|>\n" for c, _ in expected]
    assert ("cba<|end|>\n", "abc<|end|>\n") in placed  # "hello" (the prompt's reply) is not scored
    assert len(placed) == 5  # the pair longer than a row is left out
    with pytest.raises(ConfigError, match=r"train\.objective=lm cannot use"):  # the lm spec's check
        objectives.check(load_config("tiny", [f"data.sources=[{{name: p, kind: preference, path: {path}}}]"]))

    documents = tokenized_documents(data, "all", BYTE)[0].documents
    np.testing.assert_array_equal(documents[0], ENCODER.encode(pairs[0]))
    # With reference log-probabilities, each sequence's sits on its segment's first position.
    reference = {"pairs": np.arange(1, 13, dtype=np.float32).reshape(6, 2)}
    scored = make_row_iterator(
        data, BYTE, seq_len=256, seed=0, split="all", shuffle=False, repeat=False, references=reference
    )
    row = next(scored)
    firsts = np.flatnonzero((row["positions"] == 0) & (row["segment_ids"] > 0))
    np.testing.assert_array_equal(row["reference_logps"][firsts], np.arange(1, len(firsts) + 1))
    assert row["reference_logps"].sum() == np.arange(1, len(firsts) + 1).sum()


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"chosen": "a", "rejected": "b"}, "no prompt"),
        ({"prompt": "p", "rejected": "b"}, "'chosen' is missing"),
        (
            {"prompt": "p", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]},
            "no assistant message",
        ),
        ({"prompt": [{"role": "robot", "content": "p"}], "chosen": "a", "rejected": "b"}, "role 'robot'"),
        ({"prompt": "p", "chosen": "", "rejected": "b"}, "'chosen' is missing or empty"),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "are the same"),
        (
            {
                "prompt": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}],
                "chosen": "a",
                "rejected": "b",
            },
            "ends with an assistant message",
        ),
    ],
)
def test_a_bad_pair_is_named_with_its_line_or_skipped(tmp_path, record, problem):
    path = write_records(tmp_path / "pairs.jsonl", [*reverse_pairs(2), record])
    with pytest.raises(DataError, match=rf"pairs.jsonl:3: .*{problem}"):
        tokenized_documents(_data(path), "all", BYTE)
    kept = tokenized_documents(_data(path, on_bad_document="skip"), "all", BYTE)[0]
    assert len(kept.documents) == 2 and kept.skipped == 1


def _hf_completion_logps(hf, pair) -> tuple[float, float]:
    """Summed log-probabilities of the chosen and rejected completion tokens (and their EOS) in HF."""
    document = ENCODER.encode(pair)
    out = []
    for side in (1, 2):
        ids, scored = document[:2, document[2] == side]
        ids, scored = np.append(ids, BYTE.eos_id), np.append(scored, scored[-1])
        with torch.no_grad():
            logits = hf(input_ids=torch.as_tensor(ids[None]), use_cache=False).logits[0].double()
        logp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.as_tensor(ids[1:, None])).numpy()[:, 0]
        out.append(float((logp * scored[1:]).sum()))
    return out[0], out[1]


def _events(run, name):
    lines = (run / "events.jsonl").read_text().splitlines()
    return [json.loads(line)["detail"] for line in lines if json.loads(line)["event"] == name]


def test_dpo_scores_pairs_like_hf_starts_at_ln2_and_keeps_its_reference(tmp_path, capsys):
    hf = make_hf_model(seed=3, vocab_size=264)
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    pairs = reverse_pairs(12, seed=2)
    path = write_records(tmp_path / "pairs.jsonl", pairs)
    run = tmp_path / "run"
    args = [
        "train", "dpo", "--init-from", str(hf_dir), f"run.dir={run}", "--no-progress",
        f"data.sources=[{{name: pairs, kind: preference, path: {path}}}]", "data.held_out_fraction=0.2",
        "train.batch_size=2", "train.seq_len=128", "optim.warmup_steps=5", "log.every=1", "eval.every=1",
        "eval.batches=1",
    ]  # fmt: skip
    assert main([*args, "train.steps=1"]) == 0
    with np.load(run / "reference" / "logps.npz") as saved:
        reference = saved["0"]
    expected = np.asarray([_hf_completion_logps(hf, pair) for pair in pairs])
    np.testing.assert_allclose(reference, expected, atol=2e-3, rtol=0)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "loss" in r)
    assert abs(first["loss"] - math.log(2)) < 1e-5 and abs(first["reward_margin"]) < 1e-5
    assert abs(next(r for r in records if "eval_loss" in r)["eval_loss"] - math.log(2)) < 1e-5
    # (no pair_accuracy check here: with margins of 1e-7 either way, which pairs count as "right" is rounding)

    assert main([*args, "train.steps=2"]) == 0  # resumed: the stored reference, not a new pass
    assert len(_events(run, "reference")) == 1 and _events(run, "resume") == [
        {"from_step": 1, "tier": "persistent"}
    ]
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0  # the run's held-out evaluation, reproduced
    evaluated = json.loads(capsys.readouterr().out)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert abs(evaluated["loss"] - logged["eval_loss"]) < 1e-6
    assert evaluated["pair_accuracy"] == logged["eval_pair_accuracy"] and evaluated["pairs"] > 0
    write_records(path, reverse_pairs(13, seed=2))
    capsys.readouterr()
    assert main([*args, "train.steps=3"]) == 2
    assert "the preference data, tokenizer or train.seq_len changed" in capsys.readouterr().err


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo"])
def test_the_preference_losses_follow_their_formulas(tmp_path, objective):
    import dataclasses

    import jax.numpy as jnp

    from tests.random_model import random_variables, tiny_config
    from zaya_jax.loss import token_losses
    from zaya_jax.model import Zaya
    from zaya_jax.objectives import spec_for

    path = write_records(tmp_path / "pairs.jsonl", reverse_pairs(3, seed=5))
    row = next(
        make_row_iterator(_data(path), BYTE, seq_len=256, seed=0, split="all", shuffle=False, repeat=False)
    )
    model_cfg = tiny_config(vocab_size=264)
    variables = random_variables(model_cfg)
    reference = np.asarray([-30.0, -28.0, -25.0, -33.0, -27.0, -26.0], np.float32)  # (c, r) of 3 pairs
    row["reference_logps"] = np.zeros(256, np.float32)
    firsts = np.flatnonzero((row["positions"] == 0) & (row["segment_ids"] > 0))
    row["reference_logps"][firsts] = reference[: len(firsts)]
    batch = {k: jnp.asarray(v[None]) for k, v in row.items()}
    cfg = load_config(
        "tiny",
        [
            f"train.objective={objective}",
            f"data.sources=[{{name: p, kind: preference, path: {path}}}]",
            "preference.beta=0.5",
        ],
    )
    cfg = dataclasses.replace(cfg, model=model_cfg)
    loss, stats = (
        spec_for(cfg)
        .loss(cfg)
        .loss_and_stats(Zaya(model_cfg), variables["params"], variables["balancing"], batch)
    )

    logits, _ = Zaya(model_cfg).apply(variables, batch["inputs"], segment_ids=batch["segment_ids"])
    ce, _ = token_losses(logits, batch["targets"])
    logp = -np.asarray(ce)[0] * row["loss_mask"]
    seq = [logp[row["segment_ids"] == s].sum() for s in range(1, len(firsts) + 1)]
    n = [row["loss_mask"][row["segment_ids"] == s].sum() for s in range(1, len(firsts) + 1)]
    expected = []
    for k in range(len(firsts) // 2):
        c, r, rc, rr = seq[2 * k], seq[2 * k + 1], reference[2 * k], reference[2 * k + 1]
        h = (c - rc) - (r - rr)
        if objective == "dpo":
            expected.append(np.log1p(np.exp(-0.5 * h)))
        elif objective == "ipo":
            expected.append((h - 1 / (2 * 0.5)) ** 2)
        else:
            margin = 0.5 * (c / n[2 * k] - r / n[2 * k + 1]) - cfg.preference.simpo_gamma
            expected.append(np.log1p(np.exp(-margin)))
    assert float(stats["weight"]) == len(expected) >= 1
    np.testing.assert_allclose(float(loss), sum(expected), rtol=1e-4)


def _tiny_dpo(pairs, run) -> list[str]:
    """``zaya train`` arguments of a small dpo run on ``pairs``, saving every step."""
    return [
        "train", "dpo", *MINI, f"run.dir={run}", "--no-progress", "model.vocab_size=264",
        f"data.sources=[{{name: pairs, kind: preference, path: {pairs}}}]", "data.held_out_fraction=0.25",
        "train.seq_len=128", "eval.batches=1", "checkpoint.every_steps=1",
    ]  # fmt: skip


def test_damaged_reference_scores_are_computed_again_from_the_starting_weights(tmp_path, capsys):
    """A resumed dpo run whose ``reference/`` is truncated, emptied, holds a manifest of the wrong
    type, or is gone scores the pairs again from its starting weights (the seed's initialisation
    here, whose fingerprint the first pass recorded): the same values, no traceback; ``zaya eval``
    of the damaged run is one line saying how to recover."""
    path = write_records(tmp_path / "pairs.jsonl", reverse_pairs(8, seed=4))
    trained = tmp_path / "trained"
    assert main([*_tiny_dpo(path, trained), "train.steps=1"]) == 0
    with np.load(trained / "reference" / "logps.npz") as saved:
        first = saved["0"]
    for damage in ("truncated", "empty", "manifest_list", "deleted"):
        run = tmp_path / damage
        shutil.copytree(trained, run)
        stored = run / "reference" / "logps.npz"
        if damage == "truncated":
            stored.write_bytes(stored.read_bytes()[:40])
        elif damage == "empty":
            stored.write_bytes(b"")
        elif damage == "manifest_list":
            (run / "reference" / "manifest.json").write_text("[]")
        else:
            shutil.rmtree(run / "reference")
        capsys.readouterr()
        if damage != "deleted":
            assert main(["eval", str(run), "--json"]) == 2
            err = capsys.readouterr().err
            assert "Traceback" not in err and "resume the run" in err and len(err.strip().splitlines()) == 1
        assert main([*_tiny_dpo(path, run), "train.steps=2"]) == 0, damage
        assert "computing the reference log-probabilities again" in capsys.readouterr().err
        with np.load(stored) as saved:
            np.testing.assert_array_equal(saved["0"], first)
        events = _events(run, "reference")
        assert len(events) == 2 and events[1]["recomputed"] and events[0]["weights"] == events[1]["weights"]


def test_damaged_reference_scores_are_refused_when_the_starting_weights_changed(tmp_path, capsys):
    path = write_records(tmp_path / "pairs.jsonl", reverse_pairs(8, seed=4))
    run = tmp_path / "run"
    args = _tiny_dpo(path, run)
    assert main([*args, "train.steps=1"]) == 0
    shutil.rmtree(run / "reference")
    capsys.readouterr()
    assert main([*args, "train.steps=2", "train.seed=7"]) == 2  # another initialisation
    err = capsys.readouterr().err
    assert "are not the ones they were computed from" in err and "Traceback" not in err


@pytest.mark.parametrize("objective", ["simpo", "dpo"])
def test_a_source_whose_every_pair_is_too_long_is_refused_not_a_hang(tmp_path, capsys, objective):
    """simpo (no reference pass), and dpo with a second source that fits: refused by the source's
    name before step 1 (and before dpo's reference pass), not read forever by the packer."""
    long = write_records(
        tmp_path / "long.jsonl", [{"prompt": "reverse: " + "q" * 200, "chosen": "a", "rejected": "b"}] * 20
    )
    fits = write_records(tmp_path / "fits.jsonl", reverse_pairs(8, seed=4))
    sources = [f"{{name: long, kind: preference, path: {long}}}"]
    if objective == "dpo":
        sources.append(f"{{name: fits, kind: preference, path: {fits}}}")
    args = [
        "train", "dpo", *MINI, f"train.objective={objective}", f"run.dir={tmp_path / 'run'}", "--no-progress",
        "model.vocab_size=264", f"data.sources=[{', '.join(sources)}]", "data.held_out_fraction=0.25",
        "train.seq_len=128", "train.steps=2", "optim.warmup_steps=1",
    ]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "every preference pair of 'long'" in err and "raise train.seq_len" in err and "Traceback" not in err
    )
    assert "scoring" not in err and "step 1" not in err  # before the reference pass and any step


def test_the_packer_stops_a_stream_that_left_out_a_whole_pass(tmp_path):
    """The packer's own guard (a stream whose share of a source is all too long, which the check at
    start cannot see): after one pass of left-out pairs it stops instead of reading forever."""
    long = [{"prompt": "reverse: " + "q" * 200, "chosen": "a", "rejected": "b"}] * 5
    data = _data(write_records(tmp_path / "long.jsonl", long))
    rows = make_row_iterator(data, BYTE, seq_len=128, seed=0, split="all", shuffle=True, repeat=True)
    with pytest.raises(DataError, match=r"every preference pair of 'pairs' .* is longer than a row of 128"):
        next(rows)
