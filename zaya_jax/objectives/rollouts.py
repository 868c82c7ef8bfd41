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

Rollouts from files (``rl.rollouts``): JSONL records, one completion each, ``{"group": any JSON
value naming the prompt's group, "prompt_ids": [...], "completion_ids": [...], "logprobs": [...]
(one per completion token, under the distribution sampled: ``rl.temperature``, ``rl.top_k``,
``rl.top_p`` over the tokenizer's vocabulary, as vLLM's ``logprobs_mode="processed_logprobs"``
gives them), "reward": float}`` and optionally the routes the
sampler took, for router replay, for every token read (``len(prompt_ids) + len(completion_ids) -
1`` of them: every token but the last), in one of two layouts:

- zaya's: ``"routes": [[class per layer] per token read]``, a class being an expert index in
  [0, E), E (``model.num_experts``) for the skip class, or -1 where unknown (the router chooses);
- vLLM's capture (vllm-project/vllm#28284): ``"routed_experts": [[[expert] per layer] per token
  read]`` (shape tokens read x layers x top_k, top_k = 1 for ZAYA) with ``"routed_skip": [[bool
  per layer] per token read]``, true where the router chose the skip class. vLLM (upstream and
  Zyphra's ``zaya.py``) rewrites a skip choice to expert 0 with weight 0 before its fused MoE, so
  ``routed_experts`` alone cannot tell a skipped token from one routed to expert 0; every ZAYA
  router has the skip class, so a record with ``routed_experts`` and no ``routed_skip`` is refused
  (drop both to let the trainer's router choose). The mask's tokens become class E.

They are read in order, ``steps_per_rollout * train.batch_size`` at a time, advantages normalised
within the groups of each read, and the files repeat. Every batch is checked before its update is
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
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from zaya_jax.config import Config, ConfigError, ModelConfig
from zaya_jax.data import BATCH_KEYS, BadDocuments, DataError, jsonl_records
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.generate import Generation, generate
from zaya_jax.objectives.rewards import (
    PromptEncoder,
    PromptSet,
    completion_texts,
    reward_function,
    rollout_stop_ids,
)
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
        # packed batches' row counts: a multiple of what the step's batch splits into, and of an
        # eighth of train.batch_size, so that a run compiles its step for a few row counts, not many
        self.row_multiple = math.lcm(row_multiple, max(1, cfg.train.batch_size // 8))
        self.reward = reward_function(cfg)
        self.event = event
        self.prompts = prompts or PromptSet(cfg)  # held-out prompts are evaluated with file rollouts too
        self.encode = PromptEncoder(cfg, tokenizer, cfg.train.seq_len - cfg.rl.max_new_tokens)
        self.stop_ids = rollout_stop_ids(cfg, tokenizer, self.encode.chat)
        self.file_records = _read_rollout_files(cfg) if cfg.rl.rollouts else None
        self.position = {"rollouts": 0, "consumed": 0, "tokens_seen": 0}
        self.pending: list[dict[str, np.ndarray]] = []
        self.stats: tuple[tuple[str, float], ...] = ()
        self.sampling: tuple[tuple[str, float], ...] = ()  # dynamic sampling's statistics
        self.params: dict[str, Any] | None = None

    def observe(self, state: TrainState) -> None:
        self.params = {"params": state.params, "balancing": state.balancing}

    def get_state(self) -> DataPosition:
        return dict(self.position)

    def set_state(self, saved: list[DataPosition]) -> None:
        """Continue from the positions every process of the run saved (any number of processes: the
        position is global, the same in each)."""
        keys = ("rollouts", "consumed", "tokens_seen")
        positions = {tuple(int(state[k]) for k in keys) for state in saved}
        if len(positions) != 1:
            raise DataError(f"the saved rollout positions disagree on {keys}: {sorted(positions)}")
        self.position = dict(zip(keys, positions.pop(), strict=True))
        self.pending = []

    @property
    def size(self) -> int:
        return self.cfg.rl.steps_per_rollout * self.cfg.train.batch_size

    def __call__(self) -> tuple[RolloutPlan, HostBatch, DataPosition]:
        if not self.pending:
            completions = self._read() if self.file_records is not None else self._sample()
            self.pending = self._batches(completions)
            self.position["rollouts"] += 1
        batch_rows = self.pending.pop(0)
        batch = local_rows({k: np.stack([row[k] for row in batch_rows]) for k in batch_rows[0]})
        read = sum(int((row["segment_ids"] > 0).sum()) for row in batch_rows)
        plan = RolloutPlan(len(batch_rows), self.cfg.train.seq_len, 0, None,
                           (*self.stats, ("row_fill", read / (len(batch_rows) * self.cfg.train.seq_len))))  # fmt: skip
        self.position["tokens_seen"] += plan.tokens
        return plan, batch, self.get_state()

    def _sample(self) -> list[Completion]:
        """A rollout's completions; with ``rl.dynamic_sampling`` (DAPO) groups whose rewards all tie
        (no advantage, nothing to learn) are replaced by groups of further prompts, up to that many
        more rounds, the rest filled with tied groups."""
        if self.params is None:
            raise RuntimeError("Rollouts.observe(state) must be called before a rollout is sampled")
        rl = self.cfg.rl
        wanted = self.size // rl.group_size
        informative, tied, drawn = [], [], []
        for attempt in range(1 + rl.dynamic_sampling):
            completions = self._sample_round(wanted, attempt)
            drawn += completions
            for i in range(0, len(completions), rl.group_size):
                members = completions[i : i + rl.group_size]
                (informative if _learns(members) else tied).append(members)
            if not rl.dynamic_sampling or len(informative) >= wanted:
                break
        if not rl.dynamic_sampling:
            return drawn
        chosen = (informative + tied)[:wanted]
        scored = [c.reward for c in drawn if c.reward is not None]
        self.sampling = (
            ("reward_sampled", float(np.mean(scored)) if scored else float("nan")),  # every group drawn
            ("groups_replaced", float(len(drawn) // rl.group_size - wanted)),
            ("sample_rounds", float(attempt + 1)),
        )
        return [c for members in chosen for c in members]

    def _sample_round(self, prompts: int, attempt: int) -> list[Completion]:
        """``group_size`` completions of each of the next ``prompts`` prompts, in row order."""
        rl, group = self.cfg.rl, self.cfg.rl.group_size
        start = self.position["consumed"]
        records = [self.prompts.record(start + i) for i in range(prompts)]
        self.position["consumed"] += len(records)
        ids, mask, prompts = self.encode([r for r in records for _ in range(group)])
        low, high = _share(len(prompts))  # this process samples rows [low, high) of the rollout
        out = generate(
            self.cfg.model,
            process_local(self.params),
            ids[low:high],
            attention_mask=mask[low:high],
            max_new_tokens=rl.max_new_tokens,
            temperature=rl.temperature,
            top_k=rl.top_k,
            top_p=rl.top_p,
            stop_tokens=self.stop_ids,
            seed=self.cfg.train.seed * 1_000_003 + self.position["rollouts"] + attempt * 104_729,
            vocab_limit=self.tokenizer.vocab_size,
            return_routes=True,
            slots=rl.slots,
            first_stream=low,
        )
        texts = completion_texts(self.tokenizer, out.rows())
        rewards = self.reward.score([records[(low + i) // group] for i in range(len(texts))], texts)
        every = _gather_rows(out, rewards, self.cfg.train.seq_len)  # every process's rows, in row order
        completions = []
        for i, prompt in enumerate(prompts):
            n, reward = int(every["lengths"][i]), float(every["rewards"][i])
            routes = every["routes"][i, : len(prompt) + n - 1]
            parsed = None if every["parsed"][i] < 0 else bool(every["parsed"][i])
            completions.append(
                Completion(start + i // group, prompt, every["tokens"][i, :n], every["logprobs"][i, :n], None if math.isnan(reward) else reward, routes, parsed)
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


def _read_rollout_files(cfg: Config) -> list[Completion]:
    """Every record of ``rl.rollouts``, checked (see the module doc for the format)."""
    out = []
    for _, where, record in jsonl_records(cfg.rl.rollouts, BadDocuments("error"), name="rollouts"):
        try:
            out.append(_completion_from_record(record, cfg.model))
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(
                f"{where}: not a rollout record ({err}); see zaya_jax.objectives.rollouts for the format"
            ) from None
    if not out:
        raise DataError(f"rl.rollouts={cfg.rl.rollouts} holds no rollout records")
    print(f"zaya train: {len(out)} rollouts read from {cfg.rl.rollouts}", file=sys.stderr)
    return out


def _token_ids(value: Any, name: str, vocab: int) -> np.ndarray:
    ids = np.asarray(value)
    if ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a non-empty list of token ids")
    bad = ids[(ids < 0) | (ids >= vocab)]
    if len(bad):
        raise ValueError(f"{name} holds id {int(bad[0])}, outside the model's vocabulary [0, {vocab})")
    return ids.astype(np.int32)


def _completion_from_record(record: dict[str, Any], model: ModelConfig) -> Completion:
    prompt = _token_ids(record["prompt_ids"], "prompt_ids", model.vocab_size)
    tokens = _token_ids(record["completion_ids"], "completion_ids", model.vocab_size)
    logprobs = np.asarray(record["logprobs"], np.float32)
    if logprobs.shape != tokens.shape:
        raise ValueError(f"{len(logprobs)} logprobs for {len(tokens)} completion tokens")
    if not np.isfinite(logprobs).all() or logprobs.max() > 1e-4:
        raise ValueError("logprobs must be finite log-probabilities (<= 0)")
    reward = float(record["reward"])
    if not math.isfinite(reward):
        raise ValueError(f"reward {reward} is not a finite number")
    routes = _routes_from_record(record, model, len(prompt) + len(tokens) - 1)
    return Completion(record["group"], prompt, tokens, logprobs, reward, routes)


def _routes_from_record(record: dict[str, Any], model: ModelConfig, read: int) -> np.ndarray | None:
    """The record's routes as zaya classes, (tokens read, layers), or None: ``routes`` as they are,
    or vLLM's ``routed_experts`` with its ``routed_skip`` mask converted (skip -> E)."""
    layers, experts = model.num_layers, model.num_experts
    given = [name for name in ("routes", "routed_experts") if record.get(name) is not None]
    if len(given) == 2:
        raise ValueError("routes and routed_experts are two layouts of the same routes: give one")
    if record.get("routed_skip") is not None and given != ["routed_experts"]:
        raise ValueError("routed_skip is the skip mask of routed_experts, which the record lacks")
    if not given:
        return None
    if given == ["routes"]:
        routes = np.asarray(record["routes"])
        if routes.shape != (read, layers):
            raise ValueError(
                f"routes have shape {routes.shape}, expected {(read, layers)} (tokens read x layers)"
            )
        if routes.dtype.kind not in "iu" or routes.min() < -1 or routes.max() > experts:
            raise ValueError(f"routes must be classes in [-1, {experts}] (the skip class is {experts})")
        return routes.astype(np.int32)
    return _vllm_routes(record, layers, experts, read)


def _vllm_routes(record: dict[str, Any], layers: int, experts: int, read: int) -> np.ndarray:
    """vLLM's ``routed_experts`` (tokens read, layers, top_k) expert indices and the ``routed_skip``
    (tokens read, layers) mask -> zaya classes: the expert, E where the mask is set, -1 kept."""
    routed = np.asarray(record["routed_experts"])
    if routed.ndim != 3 or routed.shape[:2] != (read, layers):
        raise ValueError(
            f"routed_experts have shape {routed.shape}, expected {(read, layers, 1)} (tokens read x layers x top_k)"
        )
    if routed.shape[2] != 1:
        raise ValueError(
            f"routed_experts hold top_k={routed.shape[2]} experts per token; ZAYA routes each token to one "
            "class (top_k=1), so only top_k=1 is supported"
        )
    if routed.dtype.kind not in "iu" or routed.min() < -1 or routed.max() >= experts:
        raise ValueError(f"routed_experts must be expert indices in [0, {experts}) (-1: not recorded)")
    if record.get("routed_skip") is None:  # every ZAYA model has the skip class (E + 1 router classes)
        raise ValueError(
            f"routed_experts without routed_skip: this model's router has a skip class besides its {experts} "
            "experts, and vLLM rewrites a skip choice to expert 0 (with weight 0), so these routes cannot "
            "tell a skipped token from one routed to expert 0 and replaying them would train a path the "
            "sampler never took. Supply routed_skip ([tokens read][layers] booleans, true where the router "
            "chose the skip class), or drop routed_experts to let the trainer's router choose"
        )
    skip = np.asarray(record["routed_skip"])
    if skip.shape != (read, layers) or skip.dtype.kind not in "biu" or not np.isin(skip, (0, 1)).all():
        raise ValueError(
            f"routed_skip must be {(read, layers)} booleans (tokens read x layers), got shape {skip.shape}"
        )
    routes, skip = routed[..., 0].astype(np.int32), skip.astype(bool)
    if (skip & (routes > 0)).any():
        t, layer = (int(i[0]) for i in np.nonzero(skip & (routes > 0)))
        raise ValueError(
            f"routed_skip marks token {t} layer {layer} as skipped but routed_experts holds expert "
            f"{routes[t, layer]} there (vLLM writes 0 for a skip): the mask does not line up with the routes"
        )
    return np.where(skip, experts, routes)


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
