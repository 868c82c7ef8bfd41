"""The post-training sections: ``preference`` (DPO, IPO, SimPO) and ``rl`` (GRPO)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from zaya_jax.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning (``train.objective`` dpo, ipo or simpo) on pairs of a chosen and a rejected
    completion of one prompt. With h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log
    ref(rejected)), summed over each completion's tokens: dpo minimises -log sigmoid(beta h), ipo
    (h - 1 / (2 beta))^2; simpo uses no reference and the completions' mean log-probabilities:
    -log sigmoid(beta (mean log pi(chosen) - mean log pi(rejected)) - simpo_gamma). The reference
    log-probabilities come from the starting weights, computed once before step 1 and stored in
    the run directory (``reference/``); see :mod:`zaya_jax.objectives.reference`."""

    beta: float = 0.1  # inverse temperature of the implicit reward (SimPO papers use 2.0-2.5)
    simpo_gamma: float = 0.5  # simpo: the target margin between chosen and rejected rewards

    def validate(self) -> None:
        if not 0 < self.beta < math.inf:
            raise ConfigError(f"preference.beta={self.beta} must be a finite number > 0")
        if not 0 <= self.simpo_gamma < math.inf:
            raise ConfigError(f"preference.simpo_gamma={self.simpo_gamma} must be a finite number >= 0")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Reinforcement learning with GRPO (``train.objective: grpo``; :mod:`zaya_jax.objectives.rollouts`).

    Every ``steps_per_rollout`` steps the current policy samples ``group_size`` completions of each of
    ``steps_per_rollout * train.batch_size / group_size`` prompts with zaya's own sampler and decode
    cache, capturing each token's log-probability and the class every layer's router chose; the
    reward function scores them, and each completion's advantage is its reward minus its group's
    mean, over the group's standard deviation. The step then minimises the clipped surrogate
    -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) per completion token, r = pi / pi_sampler (with
    a sampler correction, ``tis_cap`` / ``tis_mask``, r = pi / pi_old weighted by pi_old / pi_sampler;
    GSPO's per-completion r with ``ratio``), plus
    ``kl`` times the k3 estimate of KL(pi || reference), averaged over completion tokens; with
    ``replay_routes`` every layer selects the class the sampler chose (router replay). One sequence
    per row: ``train.seq_len`` must hold the longest prompt plus ``max_new_tokens``. Rollouts can
    instead be read from files (``rollouts``; zaya's or vLLM's route layout), and every step checks
    that the trainer reproduces its rollouts' log-probabilities (``max_sampler_gap``)."""

    # The prompts: "reverse" (the built-in reverse-a-word task, zaya_jax.data.tasks) or a JSONL file of
    # chat records ({"messages": [...]}, more fields allowed); a final assistant message is left out
    # of the prompt (the reward function still sees the whole record).
    prompts: str = "reverse"
    # The reward: "module:function" called as function(record, completion_text) -> float.
    reward: str = "zaya_jax.data.tasks:reverse_reward"
    # Rollouts read from JSONL files (a file, directory or glob) instead of sampled (see
    # zaya_jax.objectives.rollouts for the record format; routes captured by another engine replay here).
    rollouts: str = ""
    group_size: int = 8  # completions sampled per prompt (the group of the advantage)
    max_new_tokens: int = 32  # longest completion
    # Completions in flight at once in the rollout engine (zaya_jax.engine): a finished one's slot
    # takes the next at once; more slots, more memory (each holds a prompt + max_new_tokens cache).
    slots: int = 64
    # Rollouts are sampled from the logits over this temperature, then rl.top_k and rl.top_p; the
    # sampler records, and the trainer and the KL reference compute, log-probabilities under this
    # same distribution (zaya_jax.ops.sampling_filter): it changes what is sampled, not which
    # policy's gradient is taken.
    temperature: float = 1.0
    top_k: int = 0  # keep only the top_k most likely tokens when sampling (0: off), in the loss too
    top_p: float = 1.0  # then the smallest set reaching probability top_p (1: off), in the loss too
    # The sampler's experts read through quantize-dequantize as a quantized export holds them ("fp8",
    # "mxfp4": zaya_jax.ops.quantization) while the trainer's stay in full precision, as RL stacks
    # sample with FP8 rollouts: the mismatch shows in sampler_gap, and rl.tis_cap weights it out.
    sampler_quantization: Literal["none", "fp8", "mxfp4"] = "none"
    # Each completion's advantage is its reward minus its group's mean, divided by the group's std
    # (GRPO); false: not divided (Dr. GRPO), so a group whose rewards differ by little moves the policy little.
    scale_advantages: bool = True
    # The loss's average: over every completion token of the batch ("token", DAPO: a long completion
    # weighs more) or per completion, then over completions ("sequence", GRPO's original).
    loss_norm: Literal["token", "sequence"] = "token"
    steps_per_rollout: int = 1  # optimizer steps on each rollout (> 1: later steps train off-policy)
    # Rollouts sampled ahead on a background thread while earlier ones train (0: synchronous, each
    # rollout sampled from the weights it trains). With k > 0, rollout j is sampled from the weights
    # rollout j - k started training with (k = 1: one-step off-policy, as PipelineRL / AReaL / verl's
    # async recipes); every completion carries that parameter version (metrics.jsonl: staleness, in
    # optimizer steps). Pair it with rl.tis_cap: the clipped ratio is then taken against the
    # trainer's weights (pi_old) and the sampler's lag is weighted out. Checkpoints also hold the k
    # sampling weights in flight, so a resumed run samples the rollouts the uninterrupted one did.
    max_staleness: int = 0
    # Completions packed several to a row of train.seq_len, each its own segment (attention,
    # positions and per-completion sums stay within it): a step trains train.batch_size completions
    # in as many rows as they fill (rounded up to an eighth of train.batch_size), not one row each
    # padded to train.seq_len. Raise train.seq_len to pack more to a row.
    pack: bool = False
    # DAPO's dynamic sampling: up to this many more rounds of prompts sampled per rollout to replace
    # groups whose rewards all tie (advantage 0: nothing to learn); 0: off. metrics.jsonl then logs
    # reward_sampled (every group drawn) apart from reward (the groups trained), groups_replaced
    # and sample_rounds.
    dynamic_sampling: int = 0
    replay_routes: bool = True  # force the sampler's routes in the training forward
    clip_low: float = 0.2  # the ratio's lower clip 1 - clip_low
    clip_high: float = 0.2  # the ratio's upper clip 1 + clip_high (DAPO's clip-higher: 0.28)
    # The ratio the clip applies to: per token ("token", PPO/GRPO), or per completion ("sequence",
    # GSPO, Zheng et al. 2025: exp of the mean over its tokens of log pi - log pi_old, one ratio
    # for every token of a completion, steadier for MoE policies; GSPO clips at 3e-4 / 4e-4).
    ratio: Literal["token", "sequence"] = "token"
    # Off-policy correction between the sampler and the trainer (truncated / masked importance
    # sampling, zaya_jax.loss.policy): with either set, the clipped ratio is taken against the
    # trainer's own log-probabilities at the rollout's parameters (pi_old), and each token's loss is
    # weighted by w = pi_old / pi_sampler, per token or per completion (tis_level), truncated at
    # tis_cap (> 0; TIS) and set to 0 outside [1 / tis_mask, tis_mask] (> 1; MIS); 0: off. It
    # corrects rollouts from another engine or older parameters (rl.rollouts, a stale sampler).
    tis_cap: float = 0.0
    tis_mask: float = 0.0  # masked importance sampling's bound M (> 1): w outside [1/M, M] set to 0
    tis_level: Literal["token", "sequence"] = "token"  # sequence: w is the product over the completion
    # Weight of KL(pi || reference) per token (0: off). > 0 keeps a copy of the starting weights on
    # the device to score every rollout.
    kl: float = 0.0
    # The largest sampler_gap (mean |log pi - log pi_sampler| over a batch's completion tokens,
    # routes replayed) a step may show before its update is rejected (resilience.on_metric_bound:
    # skip the batch or stop the run); 0: off. It checks that the trainer reproduces its rollouts,
    # those read from files above all: zaya's own sampler gives ~1e-7 on a rollout's first step,
    # while log-probabilities of other weights, tokens, sampling distribution or routes are typically off by
    # a large fraction of a nat or more. 0.5 leaves room for another engine's precision and for a
    # policy a few updates ahead of its rollout (steps_per_rollout > 1); a mean |log ratio| of 0.5
    # is far past the ratio's clip (0.2), where a batch hardly trains its policy any more.
    max_sampler_gap: float = 0.5
    eval_prompts: int = 64  # held-out prompts whose mean greedy reward is eval_reward
    # Sampled answers per held-out prompt (0: one greedy answer each). With n > 0 each prompt is
    # sampled n times as rollouts are (rl.temperature, top_k, top_p, seed train.seed) and the
    # evaluation logs, beside eval_reward (the samples' mean reward), eval_pass@1, eval_pass@n,
    # eval_maj@n and eval_avg@n (an answer correct when its reward is 1) and eval_truncated (the
    # share cut at rl.max_new_tokens), as `zaya eval RUN --task FILE` scores them (zaya_jax.scoring).
    eval_samples: int = 0
    # When the reward function raises or returns something that is not a finite number: "stop" the
    # run with its message and the prompt, or "skip" that prompt's group (advantage 0, counted as
    # reward_errors in metrics.jsonl, the first problem in a reward_error event).
    on_reward_error: Literal["stop", "skip"] = "stop"
    # Seconds a reward call may take (0: no limit); past it the call is a reward error as above.
    reward_timeout: float = 30.0
    # Processes that score a rollout's completions in parallel (0: the trainer's, one by one): for
    # rewards that take time (math-verify's symbolic checks, running code).
    reward_workers: int = 0
    prompt_seed: int = 0  # seed of the built-in task's prompts (held-out ones come from seed + 1)

    @property
    def corrected(self) -> bool:
        """Whether the loss corrects for the sampler (``tis_cap`` or ``tis_mask`` set)."""
        return self.tis_cap > 0 or self.tis_mask > 0

    def validate(self) -> None:
        for name in ("group_size", "max_new_tokens", "steps_per_rollout", "eval_prompts", "slots"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rl.{name}={getattr(self, name)} must be a positive integer")
        if self.eval_samples < 0:
            raise ConfigError(
                f"rl.eval_samples={self.eval_samples} must be >= 0 (0: one greedy answer per prompt)"
            )
        if self.group_size < 2 and not self.rollouts:
            raise ConfigError(
                f"rl.group_size={self.group_size}: a group needs >= 2 completions for an advantage"
            )
        if not 0 <= self.clip_low < 1 or not 0 <= self.clip_high < math.inf:
            raise ConfigError(
                f"rl.clip_low={self.clip_low} must be in [0, 1) and rl.clip_high={self.clip_high} a finite number >= 0"
            )
        if not (self.kl >= 0 and math.isfinite(self.kl)) or not (
            self.temperature > 0 and math.isfinite(self.temperature)
        ):
            raise ConfigError(
                f"rl.kl={self.kl} must be a finite number >= 0 and rl.temperature={self.temperature} a finite number > 0"
            )
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"rl.top_k={self.top_k} must be >= 0 (0: off) and rl.top_p={self.top_p} in (0, 1] (1: off)"
            )
        if not (self.tis_cap == 0 or 1 <= self.tis_cap < math.inf) or not (
            self.tis_mask == 0 or 1 < self.tis_mask < math.inf
        ):
            raise ConfigError(
                f"rl.tis_cap={self.tis_cap} must be 0 (off) or a finite number >= 1 and rl.tis_mask="
                f"{self.tis_mask} 0 (off) or a finite number > 1 (weights outside [1/tis_mask, tis_mask] are masked)"
            )
        if self.max_staleness < 0:
            raise ConfigError(f"rl.max_staleness={self.max_staleness} must be >= 0 (0: synchronous)")
        if self.max_staleness and self.rollouts:
            raise ConfigError(
                "rl.max_staleness samples rollouts ahead; rollouts read from files (rl.rollouts) are not "
                "sampled: set rl.max_staleness=0"
            )
        if self.dynamic_sampling < 0:
            raise ConfigError(f"rl.dynamic_sampling={self.dynamic_sampling} must be >= 0 (0: off)")
        if not 0 <= self.reward_timeout < math.inf or self.reward_workers < 0:
            raise ConfigError(
                f"rl.reward_timeout={self.reward_timeout} must be a finite number >= 0 (0: no limit) and "
                f"rl.reward_workers={self.reward_workers} >= 0 (0: score in the trainer's process)"
            )
        if not 0 <= self.max_sampler_gap < math.inf:
            raise ConfigError(
                f"rl.max_sampler_gap={self.max_sampler_gap} must be a finite number >= 0 (0: off)"
            )
        if ":" not in self.reward:
            raise ConfigError(f"rl.reward={self.reward!r} must be 'module:function'")
