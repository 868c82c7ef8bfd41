"""``train.objective: grpo``: the clipped policy-gradient objective (:mod:`zaya_jax.loss.policy`)
on rollouts the policy samples from its current weights (:mod:`.rollouts`), scored by a reward
function and evaluated by the mean greedy reward of held-out prompts (:mod:`.rewards`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from zaya_jax.config import Config, ConfigError
from zaya_jax.loss import MetricBound, Objective
from zaya_jax.loss.policy import grpo_loss_and_stats
from zaya_jax.objectives.lm import no_preference_sources
from zaya_jax.objectives.rewards import (
    HeldOutReward,
    PromptSet,
    held_out_reward,
    reward_function,
    sampled_held_out,
)
from zaya_jax.objectives.rollout_rows import rollout_fields
from zaya_jax.objectives.rollouts import Rollouts, batch_row_multiple, kl_reference, proximal_scorer
from zaya_jax.objectives.spec import ObjectiveSpec, SavedRun, register
from zaya_jax.rewards.calls import load_reward


def policy_gradient(cfg: Config) -> Objective:
    """GRPO's loss with ``cfg.rl`` bound; the batch adds the rollouts' fields, and a step whose
    trainer does not reproduce its rollouts' log-probabilities is rejected (``rl.max_sampler_gap``)."""
    gap = MetricBound(
        "sampler_gap", cfg.rl.max_sampler_gap, "rl.max_sampler_gap",
        "mean |log pi - log pi_sampler| over completion tokens: the trainer's log-probabilities, routes "
        "replayed, are not the rollouts' recorded ones; with rollouts from another engine, check its "
        "weights, tokenizer, log-probabilities (of rl.temperature/top_k/top_p's distribution) and routes",
    )  # fmt: skip
    bounds = (gap,) if cfg.rl.max_sampler_gap > 0 else ()
    return Objective(
        "grpo", functools.partial(grpo_loss_and_stats, cfg=cfg), ("loss",), rollout_fields(cfg), bounds=bounds
    )


def check_grpo(cfg: Config) -> None:
    """Rollouts in whole groups, one fixed batch, a reference for the KL term, no preference data."""
    no_preference_sources(cfg)
    rl, train = cfg.rl, cfg.train
    if (rl.steps_per_rollout * train.batch_size) % rl.group_size and not rl.rollouts:
        raise ConfigError(
            f"a rollout of rl.steps_per_rollout x train.batch_size = {rl.steps_per_rollout * train.batch_size} "
            f"sequences is not a whole number of groups of rl.group_size={rl.group_size}; make it a multiple"
        )
    if train.stages or train.batch_ramp:
        raise ConfigError(
            "train.objective=grpo takes a fixed batch: remove train.stages and train.batch_ramp"
        )
    if rl.rollouts and rl.dynamic_sampling:
        raise ConfigError(
            "rl.dynamic_sampling samples more prompts to replace tied groups; rollouts read from files "
            "(rl.rollouts) are not sampled: set rl.dynamic_sampling=0"
        )
    if rl.kl > 0 and not train.init_from:
        raise ConfigError(
            "rl.kl > 0 measures the policy's distance from its starting weights: set train.init_from"
        )
    if rl.sampler_quantization != "none":
        dataclasses.replace(cfg.model, expert_quantization=rl.sampler_quantization).validate()
    load_reward(rl.reward)  # a module that cannot be imported stops the run here, before any compile


def evaluate_saved(saved: SavedRun) -> dict[str, Any]:
    """The mean greedy reward of the run's held-out prompts (``eval_loss`` is its negation)."""
    cfg = saved.cfg
    prompts = PromptSet(cfg).held_out
    reward = reward_function(cfg)
    n = cfg.rl.eval_samples
    how = f"{n} samples each at temperature {cfg.rl.temperature}" if n else "greedy"
    what = f"the run's held-out reward (step {saved.step}): {len(prompts)} prompts, {how}, {cfg.rl.reward}"
    try:
        if n:
            scores = sampled_held_out(cfg, saved.model.variables, saved.tokenizer, prompts, reward)
        else:
            mean = held_out_reward(cfg, saved.model.variables, saved.tokenizer, prompts, reward)
            scores = {"loss": -mean, "reward": mean}
    finally:
        reward.close()
    return {**scores, "prompts": len(prompts), "evaluated": what}


GRPO = register(
    ObjectiveSpec(
        name="grpo",
        loss=policy_gradient,
        check=check_grpo,
        prepare=lambda setup: PromptSet(setup.cfg),  # shared: the producer's and the held-out prompts
        producer=lambda setup, prompts: Rollouts(
            setup.cfg,
            setup.tokenizer,
            kl_reference(setup),
            prompts,
            setup.event,
            proximal_scorer(setup),
            batch_row_multiple(setup),
        ),
        held_out=lambda setup, prompts: HeldOutReward(setup.cfg, setup.tokenizer, prompts, setup.beat),
        evaluate_saved=evaluate_saved,
    )
)
