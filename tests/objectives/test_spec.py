"""An objective is one spec: a toy objective defined and registered in this test alone (its loss,
an extra batch field, its checks, its producer and its held-out evaluator) trains through
``zaya_jax.train.train`` with no other module touched, and an ``lm`` run never enters reference,
rollout or reward code."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures import MINI
from zaya_jax import objectives
from zaya_jax.config import ConfigError, load_config
from zaya_jax.data import BATCH_KEYS
from zaya_jax.data.batch import empty_row
from zaya_jax.loss import Objective, average, loss_and_stats
from zaya_jax.objectives import ObjectiveSpec, StepPlan
from zaya_jax.train import train

SEQ = 32


def _weighted_loss(model, params, balancing, batch):
    """Next-token loss on the tokens whose ``token_weight`` (the toy's own field) is 1."""
    return loss_and_stats(
        model, params, balancing, {**batch, "loss_mask": batch["loss_mask"] * batch["token_weight"]}, 0.0, 0
    )


class Counting:
    """The toy's producer: rows counting 0, 1, 2, ... (mod 7), every other target trained."""

    prefetch = 2
    on_policy = False

    def __init__(self, rows: int):
        self.rows, self.made = rows, 0

    def observe(self, state):
        raise AssertionError("observe is for on-policy producers")

    def get_state(self):
        return {"tokens_seen": self.made * self.rows * SEQ, "made": self.made}

    def set_state(self, saved):
        self.made = saved[0]["made"]

    def __call__(self):
        row = empty_row(SEQ, 0)
        sequence = (np.arange(SEQ + 1) + self.made) % 7 + 1
        fill = {
            "inputs": sequence[:-1],
            "targets": sequence[1:],
            "segment_ids": 1,
            "positions": np.arange(SEQ),
        }
        for name, values in fill.items():
            row[name][:] = values
        row["loss_mask"][:] = 1.0
        row["token_weight"] = (np.arange(SEQ) % 2).astype(np.float32)
        batch = {k: np.stack([row[k]] * self.rows) for k in row}
        self.made += 1
        return StepPlan(self.rows, SEQ, 0, None), batch, self.get_state()


def _held_out(setup, prepared):
    batch = {k: jnp.asarray(v) for k, v in Counting(setup.cfg.train.batch_size)()[1].items()}

    def evaluate(step, state, stage):
        return average([setup.programs.eval_step(state.params, state.balancing, batch)])[0]

    return evaluate


def _check(cfg):
    if cfg.train.seq_len != SEQ:
        raise ConfigError(f"train.objective=toy trains rows of {SEQ} tokens; set train.seq_len={SEQ}")


TOY = ObjectiveSpec(
    name="toy",
    loss=lambda cfg: Objective("toy", _weighted_loss, ("loss",), {"token_weight": (np.float32, ())}),
    check=_check,
    prepare=lambda setup: "prepared",
    producer=lambda setup, prepared: Counting(setup.cfg.train.batch_size),
    held_out=_held_out,
    evaluate_saved=lambda saved: {"loss": 0.0, "evaluated": "nothing"},
)


@pytest.fixture
def toy():
    objectives.register(TOY)
    yield TOY
    objectives.unregister("toy")


def _config(run, *extra):
    cfg = load_config(
        "tiny",
        [
            *MINI,
            "train.steps=6",
            "optim.warmup_steps=1",
            "log.every=1",
            "eval.every=3",
            f"run.dir={run}",
            *extra,
        ],
    )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="toy"))


def _entered(*args, **kwargs):
    raise AssertionError("post-training code was entered")


@pytest.fixture
def no_post_training(monkeypatch):
    """Every other objective's spec replaced by one whose parts fail if called, and the
    post-training modules' entry points made to fail too."""
    from zaya_jax.objectives import reference, rewards, rollouts
    from zaya_jax.rewards import calls

    for name in ("score_pairs", "preference_references", "read_references"):
        monkeypatch.setattr(reference, name, _entered)
    for cls in (rollouts.Rollouts, rewards.PromptSet, rewards.HeldOutReward):
        monkeypatch.setattr(cls, "__init__", _entered)
    monkeypatch.setattr(calls, "load_reward", _entered)
    saved = [objectives.spec_for(name) for name in objectives.registered() if name not in ("lm", "toy")]
    parts = ("loss", "check", "prepare", "producer", "held_out", "evaluate_saved")
    for spec in saved:
        objectives.register(dataclasses.replace(spec, **dict.fromkeys(parts, _entered)), replace=True)
    yield
    for spec in saved:
        objectives.register(spec, replace=True)


def test_a_toy_objective_registered_here_trains_through_the_loop(toy, tmp_path, no_post_training):
    summary = train(_config(tmp_path / "run"), progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(losses) == 6 and len(evals) == 3  # every step logged; evaluated at steps 0, 3 and 6
    assert losses[-1] < losses[0] and evals[2] < evals[1] < evals[0]  # it learns the counting rows
    assert summary["eval_loss"] == evals[-1] and summary["tokens"] == 6 * 2 * SEQ
    # the loss saw the toy's field: half the targets trained
    assert all(r["tokens"] == 2 * SEQ // 2 for r in records if "tokens" in r and "loss" in r)


def test_the_toy_objectives_checks_run_before_the_run_starts(toy, tmp_path):
    with pytest.raises(ConfigError, match=r"train\.seq_len=32"):
        train(_config(tmp_path / "run", "train.seq_len=64"), progress=False)
    assert not (tmp_path / "run").exists()


def test_an_unknown_objective_names_the_registered_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"lm, .*grpo") as err:
        objectives.spec_for(_config(tmp_path / "run"))
    assert "toy" in str(err.value) and "register" in str(err.value)


def test_an_lm_run_never_enters_post_training_code(tmp_path, no_post_training):
    cfg = load_config("tiny", [*MINI, "train.steps=2", "optim.warmup_steps=1", f"run.dir={tmp_path / 'run'}"])
    assert train(cfg, progress=False)["steps"] == 2


def test_the_batch_has_the_fields_its_objective_declares(toy, tmp_path):
    programs = objectives.build_programs(_config(tmp_path / "run"))
    assert set(programs.abstract_batch()) == {*BATCH_KEYS, "token_weight"}
    lm = objectives.build_programs(load_config("tiny", [*MINI]))
    assert set(lm.abstract_batch()) == set(BATCH_KEYS)
