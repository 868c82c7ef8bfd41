"""``train.objective`` dpo, ipo and simpo: preference tuning on packed pairs of a chosen and a
rejected completion (the losses: :mod:`zaya_jax.loss.preference`). Their rows come from the text
producer (:class:`~zaya_jax.objectives.lm.BatchProducer`), sources of kind ``preference`` only;
dpo and ipo first score every pair with the starting weights (:mod:`.reference`) and carry those
log-probabilities in the batch (``reference_logps``), simpo needs no reference."""

from __future__ import annotations

import functools

import numpy as np

from zaya_jax.config import Config, ConfigError
from zaya_jax.loss import Objective
from zaya_jax.loss.preference import preference_loss_and_stats
from zaya_jax.objectives.held_out import HeldOut, saved_run_evaluation
from zaya_jax.objectives.lm import BatchProducer
from zaya_jax.objectives.pair_files import pair_file_evaluation
from zaya_jax.objectives.reference import (
    preference_references,
    read_references,
    refuse_sources_that_never_fit,
)
from zaya_jax.objectives.spec import ObjectiveSpec, RunSetup, register

PREFERENCE_METRICS = (
    "loss", "pair_accuracy", "reward_margin", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp",
)  # fmt: skip


def only_preference_sources(cfg: Config) -> None:
    """Refuses data sources that are not preference pairs."""
    others = [s.name for s in cfg.data.sources if s.kind != "preference"]
    if others:
        raise ConfigError(
            f"train.objective={cfg.train.objective} trains on preference pairs, but data.sources {others} are "
            "not of kind preference; give only {kind: preference, path: PAIRS.jsonl} sources"
        )


def _preference_spec(variant: str, with_reference: bool) -> ObjectiveSpec:
    fields = {"reference_logps": (np.float32, ())} if with_reference else {}

    def loss(cfg: Config) -> Objective:
        fn = functools.partial(preference_loss_and_stats, cfg=cfg, variant=variant)
        return Objective(variant, fn, PREFERENCE_METRICS, fields, unit="pairs")

    def prepare(setup: RunSetup) -> dict[str, np.ndarray] | None:
        refuse_sources_that_never_fit(setup.cfg, setup.tokenizer)
        return preference_references(setup) if with_reference else None

    return ObjectiveSpec(
        name=variant,
        loss=loss,
        check=only_preference_sources,
        producer=lambda setup, references: BatchProducer(setup.cfg, setup.tokenizer, references),
        held_out=lambda setup, references: HeldOut(setup, references),
        evaluate_saved=saved_run_evaluation(read_references if with_reference else None),
        evaluate_data=pair_file_evaluation(with_reference),
        prepare=prepare,
    )


DPO = register(_preference_spec("dpo", with_reference=True))
IPO = register(_preference_spec("ipo", with_reference=True))
SIMPO = register(_preference_spec("simpo", with_reference=False))
