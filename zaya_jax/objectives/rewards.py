"""What GRPO samples from and how it is scored: the prompt stream (``rl.prompts``), the reward
function (``rl.reward``), rendering a record's prompt with the chat template, and the held-out mean
greedy reward (``eval_reward``), which the SFT bench also uses as exact-match accuracy.

Prompts are chat records (``{"messages": [...]}``, extra fields kept for the reward function): a
trailing assistant message is the record's reference answer, left out of the prompt. ``"reverse"``
is the built-in task (:mod:`zaya_jax.data.tasks`), drawn in blocks of :data:`BLOCK` records from
``rl.prompt_seed`` (held-out prompts from another seed); a JSONL file is split into training and
held-out prompts by each record's key (``data.held_out_fraction``), training prompts reshuffled
every epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zaya_jax.config import Config, ConfigError
from zaya_jax.data import BadDocuments, DataError, jsonl_records
from zaya_jax.data.chat import ChatEncoder, check_record, rollout_stop_ids, tokenizer_chat_template
from zaya_jax.data.corpus import held_out_key
from zaya_jax.data.tasks import reverse_chats
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.generate import generate
from zaya_jax.objectives.spec import TrainState
from zaya_jax.parallel import process_local
from zaya_jax.rewards import prompt_messages
from zaya_jax.rewards.calls import RewardError, RewardFunction
from zaya_jax.scoring.answers import score_answers

BLOCK = 1024


def reward_function(cfg: Config, workers: int | None = None) -> RewardFunction:
    """``rl.reward`` with the run's error policy, time limit and workers (``rl.reward_workers``
    unless ``workers`` is given)."""
    rl = cfg.rl
    return RewardFunction(
        rl.reward, rl.on_reward_error, rl.reward_timeout, rl.reward_workers if workers is None else workers
    )


class PromptRecord(dict):
    """A record of an ``rl.prompts`` file as the reward function receives it (the file's fields),
    knowing where it was read (``file:line``), which a reward error names."""

    where: str | None = None


class PromptSet:
    """Training prompts by position (``record(i)``, any i >= 0, epochs reshuffled) and the held-out
    prompts (``held_out``), for ``cfg.rl``."""

    def __init__(self, cfg: Config):
        self.cfg, rl = cfg, cfg.rl
        if rl.prompts == "reverse":
            self._records: list[dict[str, Any]] | None = None
            self.held_out = reverse_chats(rl.eval_prompts, seed=[rl.prompt_seed, 1])
            return
        train, held_out = read_prompt_records(
            rl.prompts, cfg.data.held_out_fraction, cfg.data.on_bad_document
        )
        if not train or not held_out:
            raise DataError(
                f"rl.prompts {rl.prompts} gives {len(train)} training and {len(held_out)} held-out prompts; each "
                "split needs one (add records or change data.held_out_fraction)"
            )
        self._records, self.held_out = train, held_out[: rl.eval_prompts]
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))

    def record(self, index: int) -> dict[str, Any]:
        rl = self.cfg.rl
        if self._records is None:
            block, offset = divmod(index, BLOCK)
            return _reverse_block(rl.prompt_seed, block)[offset]
        epoch, offset = divmod(index, len(self._records))
        if self._order[0] != epoch:  # each epoch its own permutation, drawn once
            self._order = (
                epoch,
                np.random.default_rng([self.cfg.train.seed, epoch]).permutation(len(self._records)),
            )
        return self._records[int(self._order[1][offset])]


_BLOCKS: dict[tuple[int, int], list[dict[str, Any]]] = {}


def _reverse_block(seed: int, block: int) -> list[dict[str, Any]]:
    if (seed, block) not in _BLOCKS:
        if len(_BLOCKS) > 64:
            _BLOCKS.clear()
        _BLOCKS[seed, block] = reverse_chats(BLOCK, seed=[seed, 0, block])
    return _BLOCKS[seed, block]


def read_prompt_records(
    path: str, fraction: float = 0.0, on_bad: str = "error"
) -> tuple[list[dict], list[dict]]:
    """(training, held-out) chat records of a JSONL prompt file (a file, directory or glob), split by
    each record's key (``fraction`` held out); a line that is not a usable prompt is reported as
    ``on_bad`` says (``error``: one error naming file and line; ``skip``)."""
    bad = BadDocuments(on_bad)  # type: ignore[arg-type]
    train, held_out = [], []
    for key, where, record in jsonl_records(path, bad, name="prompts", kind="chat"):
        messages = record.get("messages")
        problem = (
            check_record({**record, "messages": [*messages, {"role": "assistant", "content": ""}]})
            if isinstance(messages, list)
            else f"no 'messages' list (fields: {', '.join(map(repr, record)) or 'none'})"
        )
        if problem is None and not prompt_messages(record):
            problem = "an empty prompt (no message before the reply)"
        if problem is not None:
            bad.report(f"{where}: {problem}", 'write one {"messages": [...]} prompt per line')
            continue
        read = PromptRecord(record)
        read.where = where
        (held_out if held_out_key(key, fraction) else train).append(read)
    return train, held_out


class PromptEncoder:
    """Chat records -> left-padded prompt ids of a fixed ``width`` (one compiled sampler)."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, width: int):
        self.tokenizer, self.width = tokenizer, width
        self.chat = ChatEncoder(tokenizer, tokenizer_chat_template(tokenizer))

    def __call__(self, records: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """(ids, mask) (batch, width) left-padded, and each prompt's ids."""
        prompts = []
        for record in records:
            ids = self.tokenizer.encode(self.chat.prompt(prompt_messages(record), record.get("tools")))
            if len(ids) > self.width:
                where = getattr(record, "where", None)
                raise ConfigError(
                    f"{f'{where}: ' if where else ''}a prompt of {len(ids)} tokens does not fit: train.seq_len - "
                    f"rl.max_new_tokens = {self.width}; raise train.seq_len or shorten the prompt"
                )
            prompts.append(np.asarray(ids, np.int32))
        ids = np.full((len(prompts), self.width), self.tokenizer.pad_id, np.int32)
        mask = np.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, self.width - len(prompt) :], mask[row, self.width - len(prompt) :] = prompt, 1
        return ids, mask, prompts


def completion_texts(tokenizer: Tokenizer, rows: list[list[int]]) -> list[str]:
    """Generated ids -> the text the reward function receives: the completion as the chat template
    renders it, special tokens kept as their text (the stop token included: ``"cba<|im_end|>"``
    after ChatML's end of turn; a completion cut at ``rl.max_new_tokens`` has none). The byte
    tokenizer's special ids (EOS) have no text."""
    return [tokenizer.decode(row, skip_special_tokens=False) for row in rows]


def held_out_scores(
    cfg: Config,
    variables: dict[str, Any],
    tokenizer: Tokenizer,
    records: Sequence[dict[str, Any]],
    reward: Callable[[dict[str, Any], str], float | None],
) -> list[float]:
    """The rewards of greedy completions (``rl.max_new_tokens``) of ``records``' prompts that
    ``reward`` scored (None: skipped, see :class:`RewardFunction`; a :class:`RewardFunction` scores
    them in its workers)."""
    encode = PromptEncoder(cfg, tokenizer, cfg.train.seq_len - cfg.rl.max_new_tokens)
    ids, mask, _ = encode(records)
    out = generate(
        cfg.model,
        variables,
        ids,
        attention_mask=mask,
        max_new_tokens=cfg.rl.max_new_tokens,
        stop_tokens=rollout_stop_ids(cfg, tokenizer, encode.chat),
        vocab_limit=tokenizer.vocab_size,
        slots=cfg.rl.slots,
    )
    texts = completion_texts(tokenizer, out.rows())
    if isinstance(reward, RewardFunction):
        values = reward.score(records, texts)
    else:
        values = [reward(r, t) for r, t in zip(records, texts, strict=True)]
    scores = [value for value in values if value is not None]
    if not scores:
        raise RewardError(f"no held-out completion could be scored: {getattr(reward, 'problem', '')}")
    return scores


def held_out_reward(
    cfg: Config,
    variables: dict[str, Any],
    tokenizer: Tokenizer,
    records: Sequence[dict[str, Any]],
    reward: Callable[[dict[str, Any], str], float | None],
) -> float:
    """The mean reward of :func:`held_out_scores`."""
    return float(np.mean(held_out_scores(cfg, variables, tokenizer, records, reward)))


def unparsed_share(values: Sequence[Any]) -> float | None:
    """The share of ``values`` that are :class:`zaya_jax.rewards.Score` marked unparsed, among those
    that carry the mark (None when none does: the reward function does not parse answers)."""
    marked = [value.parsed for value in values if hasattr(value, "parsed")]
    return float(np.mean([not parsed for parsed in marked])) if marked else None


def sampled_held_out(
    cfg: Config,
    variables: dict[str, Any],
    tokenizer: Tokenizer,
    records: Sequence[dict[str, Any]],
    reward: Any,
) -> dict[str, float]:
    """The held-out prompts sampled ``rl.eval_samples`` times each, as rollouts are sampled, and
    scored by :func:`zaya_jax.scoring.answers.score_answers` (as ``zaya eval --task`` scores): ``reward`` (the samples' mean),
    ``pass@1``, ``pass@n``, ``maj@n``, ``avg@n``, ``truncated`` and ``reward_unparsed``."""
    rl, n = cfg.rl, cfg.rl.eval_samples
    result = score_answers(
        cfg.model, variables, tokenizer, records, check=reward, samples=n, ks=sorted({1, n}), temperature=rl.temperature, top_p=rl.top_p,
        top_k=rl.top_k, max_new_tokens=rl.max_new_tokens, seed=cfg.train.seed, slots=rl.slots,
    )  # fmt: skip
    scores = {name: e.value for name, e in result.metrics.items() if name != "score"}
    mean = result.metrics["score"].value
    return {
        "loss": -mean,
        "reward": mean,
        **scores,
        "truncated": result.truncated,
        "reward_unparsed": result.unparsed,
    }


class HeldOutReward:
    """A ``grpo`` run's held-out evaluation: the mean greedy reward of the held-out prompts
    (``eval_reward``; ``eval_loss`` is its negation, so ``checkpoint.keep_best`` keeps the best;
    ``eval_reward_unparsed``: the share of replies whose answer the reward could not read, with a
    reward that says so, :class:`zaya_jax.rewards.Score`)."""

    def __init__(
        self, cfg: Config, tokenizer: Tokenizer, prompts: PromptSet, beat: Callable[[int, str], None]
    ):
        self.cfg, self.tokenizer, self.prompts, self.beat = cfg, tokenizer, prompts, beat
        self.reward = reward_function(cfg)

    def __call__(self, step: int, state: TrainState, stage: int = 0) -> dict[str, float]:
        self.beat(step, "eval")  # a grpo run has no stages
        variables = process_local({"params": state.params, "balancing": state.balancing})  # each process: all
        if self.cfg.rl.eval_samples:
            return sampled_held_out(self.cfg, variables, self.tokenizer, self.prompts.held_out, self.reward)
        scores = held_out_scores(self.cfg, variables, self.tokenizer, self.prompts.held_out, self.reward)
        mean, unparsed = float(np.mean(scores)), unparsed_share(scores)
        return {"loss": -mean, "reward": mean, **({} if unparsed is None else {"reward_unparsed": unparsed})}
