"""The ``tiny-recipe`` preset end to end, scaled down to two steps a stage: its three stages run in
one run (stage 3 with its own rows, batch and RoPE base), the held-out evaluation and checkpoints
follow the model in force, the passkey check runs on it at 4x stage 1's length, and the Hugging
Face export of the extended model carries the raised base. ``zaya1-8b-recipe`` loads with ZAYA1-8B's
shapes and ends at its published RoPE."""

from __future__ import annotations

import dataclasses
import json

from tests.fixtures import MINI
from zaya_jax.config import load_config


def test_the_8b_recipe_has_three_stages_and_ends_at_zaya1_8bs_config():
    recipe, released = load_config("zaya1-8b-recipe"), load_config("zaya1-8b")
    assert [s.seq_len for s in recipe.train.stages] == [4096, 4096, 32768]
    assert sum(s.tokens for s in recipe.train.stages) == 12 * 10**12
    assert recipe.stage_model(2) == released.model  # the last stage is ZAYA1-8B's model
    assert recipe.stage_model(0).rope_theta == 5e5


def test_the_tiny_recipe_runs_all_three_stages_and_extends_the_context(tmp_path, capsys):
    from zaya_jax.cli import main
    from zaya_jax.train import train

    run = tmp_path / "run"
    cfg = load_config(
        "tiny-recipe",
        [*MINI, f"run.dir={run}", "train.steps=6", "log.every=1", "eval.every=2", "optim.warmup_steps=1"],
    )
    rows = [cfg.train.batch_size, cfg.train.batch_size, 1]  # two steps a stage
    stages = tuple(
        dataclasses.replace(s, tokens=2 * r * s.seq_len, batch_size=r if s.batch_size else None)
        for s, r in zip(cfg.train.stages, rows, strict=True)
    )
    train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stages=stages)), progress=False)

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["stage"], r["seq_len"], r["batch_size"]) for r in records if "loss" in r]
    assert steps == [(0, 128, 2)] * 2 + [(1, 128, 2)] * 2 + [(2, 512, 1)] * 2
    assert all(r["eval_loss"] > 0 for r in records if "eval_loss" in r)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    compiled = [e["detail"] for e in events if e["event"] == "compiled"]
    assert sorted((tuple(c["batch"]), c.get("stage")) for c in compiled) == [((1, 512), 2), ((2, 128), None)]

    capsys.readouterr()
    assert main(["eval", str(run), "--passkey", "512", "--passkey-prompts", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passkey"][0]["length"] == 512
    assert main(["convert", "zaya-to-hf", str(run), str(tmp_path / "hf")]) == 0
    rope = json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]
    assert rope["hybrid"]["rope_theta"] == 100000.0
