"""GRPO's batches: rollouts sampled by the policy being trained (or read from files), scored, and
turned into training rows with each token's sampler log-probability, its completion's advantage
and, for router replay, the class every layer chose for it.

Every ``rl.steps_per_rollout`` steps, :class:`Rollouts` takes the next prompts of the stream
(:class:`~zaya_jax.objectives.rewards.PromptSet`), samples ``rl.group_size`` completions of each with
zaya's sampler and decode cache (:func:`zaya_jax.generate.generate`, ``return_routes``) from the
current parameters (handed over by :meth:`Rollouts.observe` before each step; ``rl.slots`` completions
in flight in the rollout engine, :mod:`zaya_jax.engine`), scores them with the
reward function, normalises the rewards within each group (reward minus the group mean, over the
group's standard deviation; 0 when all are equal) and builds one row per completion. The rollout's
rows are then trained ``train.batch_size`` at a time.

With ``rl.max_staleness = k`` rollout j is sampled on a background thread from the weights of
rollout j - k's first step while earlier rollouts train (:mod:`.ahead`); every completion carries
that parameter version.

Rollouts can be read from files instead (``rl.rollouts``, :mod:`.rollout_files`): in order,
``steps_per_rollout * train.batch_size`` at a time, advantages normalised within the groups of each
read, and the files repeat. Every batch is checked before its update is
kept: the trainer's log-probabilities (routes replayed) against the recorded ones, ``sampler_gap``
(mean |log pi - log pi_sampler| over completion tokens) at most ``rl.max_sampler_gap``, else the
step is skipped or the run stops (``resilience.on_metric_bound``).

On several processes (``jax.distributed``) process p of P samples rows [p n / P, (p + 1) n / P) of
a rollout's n rows (whole prompts' groups or not) on its own devices, with the parameters made
usable by it alone (:func:`~zaya_jax.parallel.process_local`: its shards in place when the layout
keeps them within a process, else gathered); row i draws from the stream (seed, i) whichever process
samples it. Every process's tokens, log-probabilities, routes and rewards are then gathered
(``process_allgather`` of fixed-shape arrays), so that every process builds the same rollout, its
advantages over whole groups, and takes its rows of each batch (:func:`~zaya_jax.parallel.local_rows`,
as pretraining's streams do): a rollout, and the run, are the same on any number of processes.

The data position in a checkpoint is the number of rollouts taken, of prompts (or file records)
consumed and of tokens trained, the same in every process; a run resumed (on any number of processes)
in the middle of a rollout starts the next one (the rest of the interrupted rollout is not trained).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from zaya_jax.config import Config, ConfigError
from zaya_jax.data import BATCH_KEYS, DataError
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.generate import Generation, generate
from zaya_jax.objectives.ahead import Ahead
from zaya_jax.objectives.rewards import (
    PromptEncoder,
    PromptSet,
    completion_texts,
    reward_function,
    rollout_stop_ids,
)
from zaya_jax.objectives.rollout_files import read_rollout_files
from zaya_jax.objectives.rollout_rows import (
    Completion,
    completion_row,
    group_advantages,
    needs_proximal,
    packed_rows,
)
from zaya_jax.objectives.spec import DataPosition, HostBatch, RunSetup, StepPlan, TrainState
from zaya_jax.parallel import local_rows, process_local, put_batch

# (host batch, variables) -> (rows, seq) target log-probabilities
Scorer = Callable[[HostBatch, dict[str, Any] | None], np.ndarray]
# (count) -> the weights of the ``count`` rollouts in flight at the checkpoint resumed, or None
AheadReader = Callable[[int], list[dict[str, Any]] | None]


@dataclasses.dataclass(frozen=True)
class Round:
    """One round of a rollout as this process sampled it: every row's prompt ids (every
    process's), this process's generation and rewards, the rows' first prompt position and the
    weights' version."""

    start: int
    prompts: list[np.ndarray]
    out: Generation
    rewards: list[float | None]
    version: int


@dataclasses.dataclass(frozen=True)
class Sampled:
    """A sampled rollout: its completions (or, sampled ahead on several processes, the ``local``
    round left to gather on the main thread), the prompt position after it, the version of the
    weights that sampled it and dynamic sampling's statistics."""

    completions: list[Completion] | None
    consumed: int
    version: int
    stats: tuple[tuple[str, float], ...] = ()
    local: Round | None = None


@dataclasses.dataclass(frozen=True)
class RolloutPlan(StepPlan):
    """A step's plan with the statistics of the rollout its batch comes from (``metrics.jsonl``)."""

    rollout: tuple[tuple[str, float], ...] = ()

    def fields(self) -> dict[str, Any]:
        return {**super().fields(), **dict(self.rollout)}


class Rollouts:
    """The batch producer of a ``grpo`` run (:class:`~zaya_jax.objectives.spec.Producer`): on
    policy, so :meth:`observe` hands it the state the next batch is sampled from, and nothing is
    prefetched."""

    prefetch = 0
    on_policy = True

    def __init__(
        self,
        cfg: Config,
        tokenizer: Tokenizer,
        reference: Scorer | None = None,
        prompts: PromptSet | None = None,
        event: Callable[..., None] = lambda name, **detail: None,
        proximal: Scorer | None = None,
        row_multiple: int = 1,
    ):
        """``reference(host batch, sampled-from variables) -> (rows, seq)`` target log-probabilities of the reference
        weights (needed when ``rl.kl > 0``, see :func:`kl_reference`); ``prompts`` the run's
        prompt set (default: read from ``cfg.rl``); ``event(name, **detail)`` records what a
        rollout skipped (``reward_error``); ``proximal`` the trainer's log-probabilities at the
        rollout's parameters (needed when :func:`needs_proximal`, see :func:`proximal_scorer`);
        ``row_multiple``: what a packed batch's row count must be a multiple of (the batch's shards
        times ``train.micro_batches``, see :func:`batch_row_multiple`)."""
        if cfg.rl.kl > 0 and reference is None:
            raise ConfigError("rl.kl > 0 needs the reference weights to score rollouts: see kl_reference")
        if needs_proximal(cfg) and proximal is None:
            raise ConfigError(
                "rl.tis_* with rl.steps_per_rollout > 1 needs the trainer's scores: see proximal_scorer"
            )
        self.cfg, self.tokenizer, self.reference, self.proximal = cfg, tokenizer, reference, proximal
        # the model the sampler runs: the trainer's, its experts quantized with rl.sampler_quantization
        quantized = cfg.rl.sampler_quantization
        self.sampler_model = (
            cfg.model
            if quantized == "none"
            else dataclasses.replace(cfg.model, expert_quantization=quantized)
        )
        # packed batches' row counts: a multiple of what the step's batch splits into, and of an
        # eighth of train.batch_size, so that a run compiles its step for a few row counts, not many
        self.row_multiple = math.lcm(row_multiple, max(1, cfg.train.batch_size // 8))
        rl = cfg.rl
        if rl.max_staleness and rl.dynamic_sampling and jax.process_count() > 1:
            raise ConfigError(
                "rl.dynamic_sampling decides each round on every process's rewards, which rollouts "
                "sampled ahead (rl.max_staleness) gather on the main thread only: on several processes "
                "set one of them to 0"
            )
        # off the main thread no timer can cut a reward call: a time limit there needs a worker process
        timed = rl.max_staleness and rl.reward_timeout and not rl.reward_workers
        self.reward = reward_function(cfg, workers=1 if timed else None)
        self.event = event
        self.prompts = prompts or PromptSet(cfg)  # held-out prompts are evaluated with file rollouts too
        self.encode = PromptEncoder(cfg, tokenizer, cfg.train.seq_len - cfg.rl.max_new_tokens)
        self.stop_ids = rollout_stop_ids(cfg, tokenizer, self.encode.chat)
        self.file_records = read_rollout_files(cfg) if cfg.rl.rollouts else None
        self.position = {"rollouts": 0, "consumed": 0, "tokens_seen": 0}
        self.pending: list[dict[str, np.ndarray]] = []
        self.stats: tuple[tuple[str, float], ...] = ()
        self.sampling: tuple[tuple[str, float], ...] = ()  # dynamic sampling's statistics
        self.params: dict[str, Any] | None = None
        self.version = 0  # the optimizer steps of self.params
        self.saved_versions: list[int] = []  # of the rollouts in flight at the checkpoint resumed
        last = -(-cfg.train.steps // rl.steps_per_rollout) - 1  # the rollout of the final step
        self.ahead = Ahead(rl.max_staleness, self._sample, last) if rl.max_staleness else None

    def observe(self, state: TrainState) -> None:
        self.params = {"params": state.params, "balancing": state.balancing}
        self.version = int(state.step)  # the previous step is finished (on policy): no wait

    def get_state(self) -> DataPosition:
        ahead = {"ahead": self.ahead.versions()} if self.ahead is not None else {}
        return {**self.position, **ahead}

    def ahead_weights(self) -> list[dict[str, Any]] | None:
        """The weights of the rollouts sampled ahead and not yet trained (saved with a checkpoint)."""
        return self.ahead.weights() if self.ahead is not None else None

    def set_state(self, saved: list[DataPosition]) -> None:
        """Continue from the positions every process of the run saved (any number of processes: the
        position is global, the same in each)."""
        keys = ("rollouts", "consumed", "tokens_seen")
        positions = {(*(int(state[k]) for k in keys), tuple(state.get("ahead", ()))) for state in saved}
        if len(positions) != 1:
            raise DataError(f"the saved rollout positions disagree on {keys}: {sorted(positions)}")
        *position, versions = positions.pop()
        self.position = dict(zip(keys, position, strict=True))
        self.pending, self.saved_versions = [], list(versions)

    def resume_ahead(self, read: AheadReader) -> None:
        """After :meth:`set_state`: sample the rollouts that were in flight at the checkpoint again
        from their weights, ``read(count)`` from it (``rl.max_staleness``)."""
        versions = self.saved_versions
        if self.ahead is None or not versions:
            return
        weights = read(len(versions)) if len(versions) <= self.ahead.depth else None
        if weights is None:  # another rl.max_staleness, or no weights saved: sampled from the resumed ones
            self.event("rollouts_resampled", versions=versions, max_staleness=self.ahead.depth)
            return
        self.ahead.restore(versions, weights)

    def close(self) -> None:
        """Stop sampling ahead (waits for the rollout being sampled) and end the reward's workers."""
        if self.ahead is not None:
            self.ahead.close()
        self.reward.close()

    @property
    def size(self) -> int:
        return self.cfg.rl.steps_per_rollout * self.cfg.train.batch_size

    def __call__(self) -> tuple[RolloutPlan, HostBatch, DataPosition]:
        if not self.pending:
            self.pending = self._batches(self._next_rollout())
            self.position["rollouts"] += 1
        batch_rows = self.pending.pop(0)
        batch = local_rows({k: np.stack([row[k] for row in batch_rows]) for k in batch_rows[0]})
        read = sum(int((row["segment_ids"] > 0).sum()) for row in batch_rows)
        fill = ("row_fill", read / (len(batch_rows) * self.cfg.train.seq_len))
        plan = RolloutPlan(len(batch_rows), self.cfg.train.seq_len, 0, None, rollout=(*self.stats, fill))
        self.position["tokens_seen"] += plan.tokens
        return plan, batch, self.get_state()

    def _next_rollout(self) -> list[Completion]:
        """The next rollout's completions: read from files, sampled now (synchronous) or taken
        from those sampled ahead, and the prompt position after it."""
        if self.file_records is not None:
            return self._read()
        if self.params is None:
            raise RuntimeError("Rollouts.observe(state) must be called before a rollout is sampled")
        index, consumed = self.position["rollouts"], self.position["consumed"]
        if self.ahead is None:
            sampled = self._sample(index, consumed, process_local(self.params), self.version)
        else:
            sampled = self.ahead.next(index, consumed, self.params, self.version)
        completions = sampled.completions
        if sampled.local is not None:  # sampled ahead on several processes: gathered here
            completions = self._gathered(sampled.local)
        self.position["consumed"] = sampled.consumed
        self.sampling = sampled.stats
        if self.ahead is not None:
            self.sampling += (("staleness", float(self.version - sampled.version)),)
        return completions

    def _sample(self, index: int, start: int, variables: dict[str, Any], version: int) -> Sampled:
        """Rollout ``index``'s completions, its prompts from position ``start``, sampled from this
        process's ``variables`` (optimizer step ``version``); with ``rl.dynamic_sampling`` (DAPO)
        groups whose rewards all tie (no advantage, nothing to learn) are replaced by groups of
        further prompts, up to that many more rounds, the rest filled with tied groups. Sampled
        ahead on several processes, the one round's rows are left to gather (:meth:`_gathered`)."""
        rl = self.cfg.rl
        wanted = self.size // rl.group_size
        informative, tied, drawn = [], [], []
        for attempt in range(1 + rl.dynamic_sampling):
            round_ = self._sample_round(
                index, start + len(drawn) // rl.group_size, wanted, attempt, variables, version
            )
            if self.ahead is not None and jax.process_count() > 1:  # no dynamic sampling (see __init__)
                return Sampled(None, start + wanted, version, local=round_)
            completions = self._gathered(round_)
            drawn += completions
            for i in range(0, len(completions), rl.group_size):
                members = completions[i : i + rl.group_size]
                (informative if _learns(members) else tied).append(members)
            if not rl.dynamic_sampling or len(informative) >= wanted:
                break
        consumed = start + len(drawn) // rl.group_size
        if not rl.dynamic_sampling:
            return Sampled(drawn, consumed, version)
        chosen = (informative + tied)[:wanted]
        scored = [c.reward for c in drawn if c.reward is not None]
        stats = (
            ("reward_sampled", float(np.mean(scored)) if scored else float("nan")),  # every group drawn
            ("groups_replaced", float(len(drawn) // rl.group_size - wanted)),
            ("sample_rounds", float(attempt + 1)),
        )
        return Sampled([c for members in chosen for c in members], consumed, version, stats)

    def _sample_round(
        self, index: int, start: int, prompts: int, attempt: int, variables: dict[str, Any], version: int
    ) -> Round:
        """``group_size`` completions of each of the ``prompts`` prompts from position ``start``,
        this process's share of the rows sampled and scored (no collective: it may run on the
        sampling thread)."""
        rl, group = self.cfg.rl, self.cfg.rl.group_size
        records = [self.prompts.record(start + i) for i in range(prompts)]
        ids, mask, encoded = self.encode([r for r in records for _ in range(group)])
        low, high = _share(len(encoded))  # this process samples rows [low, high) of the rollout
        out = generate(
            self.sampler_model,
            variables,
            ids[low:high],
            attention_mask=mask[low:high],
            max_new_tokens=rl.max_new_tokens,
            temperature=rl.temperature,
            top_k=rl.top_k,
            top_p=rl.top_p,
            stop_tokens=self.stop_ids,
            seed=self.cfg.train.seed * 1_000_003 + index + attempt * 104_729,
            vocab_limit=self.tokenizer.vocab_size,
            return_routes=True,
            slots=rl.slots,
            first_stream=low,
        )
        texts = completion_texts(self.tokenizer, out.rows())
        rewards = self.reward.score([records[(low + i) // group] for i in range(len(texts))], texts)
        return Round(start, encoded, out, rewards, version)

    def _gathered(self, round_: Round) -> list[Completion]:
        """A round's completions, every process's rows gathered (a collective: the main thread's)."""
        every = _gather_rows(round_.out, round_.rewards, self.cfg.train.seq_len)  # in row order
        completions, group = [], self.cfg.rl.group_size
        for i, prompt in enumerate(round_.prompts):
            n, reward = int(every["lengths"][i]), float(every["rewards"][i])
            routes = every["routes"][i, : len(prompt) + n - 1]
            parsed = None if every["parsed"][i] < 0 else bool(every["parsed"][i])
            completions.append(
                Completion(round_.start + i // group, prompt, every["tokens"][i, :n], every["logprobs"][i, :n],
                           None if math.isnan(reward) else reward, routes, parsed, round_.version)
            )  # fmt: skip
        return completions

    def _read(self) -> list[Completion]:
        records = self.file_records
        start = self.position["consumed"]
        self.position["consumed"] += self.size
        return [records[(start + i) % len(records)] for i in range(self.size)]

    def _batches(self, completions: list[Completion]) -> list[list[dict[str, np.ndarray]]]:
        """The rollout's steps' batches: ``train.batch_size`` completions each, one per row, or packed
        (``rl.pack``) into as many rows as they fill, rounded up to :attr:`row_multiple`."""
        rows, advantages = self._rows(completions)
        size = self.cfg.train.batch_size
        if not self.cfg.rl.pack:
            return [rows[i : i + size] for i in range(0, len(rows), size)]
        pad, vocab = self.tokenizer.pad_id, self.tokenizer.vocab_size
        batches = [
            packed_rows(self.cfg, completions[i : i + size], advantages[i : i + size], pad, vocab, self.row_multiple)
            for i in range(0, len(completions), size)
        ]  # fmt: skip
        for batch in batches:
            self._score_rows(batch)
        return batches

    def _rows(self, completions: list[Completion]) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
        failed = {json.dumps(c.group, sort_keys=True) for c in completions if c.reward is None}
        scored = np.asarray([json.dumps(c.group, sort_keys=True) not in failed for c in completions])
        # a group with an unscored completion trains nothing: equal rewards, advantage 0
        rewards = np.asarray(
            [c.reward if s else 0.0 for c, s in zip(completions, scored, strict=True)], np.float32
        )
        advantages, group_std = group_advantages(
            [c.group for c in completions], rewards, self.cfg.rl.scale_advantages
        )
        if failed:
            self.event("reward_error", groups=len(failed), first=self.reward.problem)
        pad = self.tokenizer.pad_id
        rows = []
        if not self.cfg.rl.pack:
            rows = [
                completion_row(self.cfg, c, float(a), pad, self.tokenizer.vocab_size)
                for c, a in zip(completions, advantages, strict=True)
            ]
            self._score_rows(rows)
        self.stats = (
            ("reward", float(rewards[scored].mean()) if scored.any() else float("nan")),
            ("reward_group_std", float(group_std)),
            ("completion_length", float(np.mean([len(c.tokens) for c in completions]))),
            ("zero_advantage", float(np.mean(advantages == 0))),
            *((("reward_errors", float(len(failed))),) if self.cfg.rl.on_reward_error == "skip" else ()),
            *_unparsed_stat(completions),
            *self.sampling,
        )
        return rows, advantages

    def _score_rows(self, rows: list[dict[str, np.ndarray]]) -> None:
        if self.reference is not None:
            self._score(rows, "reference_logprobs", self.reference, BATCH_KEYS)
        if self.proximal is not None:  # the trainer as the rollout's first step sees it: routes replayed
            self._score(rows, "proximal_logprobs", self.proximal, (*BATCH_KEYS, "routes"))

    def _score(
        self, rows: list[dict[str, np.ndarray]], field: str, scorer: Scorer, keys: tuple[str, ...]
    ) -> None:
        """Each completion token's log-probability by ``scorer`` into ``field``: the text and the
        sampled vocabulary (the reference routes as it does; the proximal pass replays the routes)."""
        batch = {k: np.stack([row[k] for row in rows]) for k in (*keys, "vocab_limit")}
        logprobs = np.asarray(scorer(batch, self.params))
        for row, values in zip(rows, logprobs, strict=True):
            row[field] = np.where(row["loss_mask"] > 0, values, 0.0).astype(np.float32)


def _learns(group: list[Completion]) -> bool:
    """Whether a group's rewards differ (an advantage to learn from): all scored, not all equal."""
    rewards = [c.reward for c in group]
    return None not in rewards and float(np.std(rewards)) >= 1e-6


def _unparsed_stat(completions: list[Completion]) -> tuple[tuple[str, float], ...]:
    """``reward_unparsed``: the share of completions whose answer the reward could not read, where
    the reward says (:class:`zaya_jax.rewards.Score`)."""
    marked = [c.parsed for c in completions if c.parsed is not None]
    return (("reward_unparsed", float(np.mean([not p for p in marked]))),) if marked else ()


def _share(rows: int) -> tuple[int, int]:
    """The rows [low, high) of a rollout's ``rows`` (a multiple of the process count: whole
    ``train.batch_size`` batches) that this process samples."""
    count, index = jax.process_count(), jax.process_index()
    return index * rows // count, (index + 1) * rows // count


def _gather_rows(out: Generation, rewards: list[float | None], seq_len: int) -> dict[str, np.ndarray]:
    """This process's sampled rows and their rewards (NaN: unscored) as fixed-shape arrays, joined
    with every other process's in process order (row order: see :func:`_share`): ``tokens``,
    ``lengths``, ``logprobs``, ``rewards`` and ``routes`` (rows, ``seq_len``, layers) aligned with
    each row's prompt and completion, -1 after them."""
    routes = np.full((len(rewards), seq_len, out.routes.shape[-1]), -1, np.int32)
    for i in range(len(rewards)):
        row = out.row_routes(i)[:-1]
        routes[i, : len(row)] = row
    mine = {
        "tokens": out.tokens,
        "lengths": out.lengths,
        "logprobs": out.logprobs,
        "rewards": np.asarray([np.nan if r is None else r for r in rewards], np.float32),
        # 1 / 0: the reward read an answer / did not (zaya_jax.rewards.Score); -1: it does not say
        "parsed": np.asarray([int(getattr(r, "parsed", -1)) for r in rewards], np.int32),
        "routes": routes,
    }
    if jax.process_count() == 1:
        return mine
    return {k: np.asarray(v) for k, v in multihost_utils.process_allgather(mine, tiled=True).items()}


def batch_row_multiple(setup: RunSetup) -> int:
    """What a batch's row count must be a multiple of: the devices its rows are split over (the
    layout's batch sharding) and ``train.micro_batches``."""
    sharding = setup.programs.layout.batch
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.lcm(math.prod(sharding.mesh.shape[a] for a in axes), setup.cfg.train.micro_batches)


def proximal_scorer(setup: RunSetup) -> Scorer | None:
    """``(host batch, sampled-from variables) -> (rows, seq)`` target log-probabilities of the
    trainer at those parameters (routes replayed as the step replays them), or None when the run
    does not need them (:func:`needs_proximal`)."""
    if not needs_proximal(setup.cfg):
        return None
    programs, replay = setup.programs, setup.cfg.rl.replay_routes
    step, layout = programs.token_logprobs_step, programs.layout

    def score(batch: HostBatch, observed: dict[str, Any] | None) -> np.ndarray:
        if observed is None:
            raise RuntimeError("the proximal log-probabilities need the parameters a rollout was taken at")
        batch = batch if replay else {k: v for k, v in batch.items() if k != "routes"}
        placed = put_batch(local_rows(batch), layout.batch)
        return np.asarray(step(observed["params"], observed["balancing"], placed))  # replicated

    return score


def kl_reference(setup: RunSetup) -> Scorer | None:
    """``(host batch, sampled-from variables or None) -> (rows, seq)`` target log-probabilities
    under the run's starting weights, or None when ``rl.kl`` is 0. With a frozen base the reference
    is the parameter plan's: the sampled-from parameters with their adapters switched off, the same
    base arrays (no second copy of the model); otherwise (and for rollouts read from files)
    ``train.init_from``'s weights, kept on the device for the run."""
    if setup.cfg.rl.kl == 0:
        return None
    programs, kept = setup.programs, []
    step, layout = programs.token_logprobs_step, programs.layout

    def score(batch: HostBatch, observed: dict[str, Any] | None) -> np.ndarray:
        reference = layout.parameters.reference(observed["params"]) if observed is not None else None
        if reference is not None:
            params, balancing = reference, observed["balancing"]
        else:
            if not kept:
                kept.append(setup.starting_weights())
            params, balancing = kept[0].params, kept[0].balancing
        return np.asarray(step(params, balancing, put_batch(local_rows(batch), layout.batch)))  # replicated

    return score
