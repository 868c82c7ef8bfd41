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

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zaya_jax.config import Config, ConfigError
from zaya_jax.data import BadDocuments, DataError, jsonl_records
from zaya_jax.data.chat import ChatEncoder, check_record, tokenizer_chat_template
from zaya_jax.data.corpus import held_out_key
from zaya_jax.data.tasks import reverse_chats
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.generate import generate
from zaya_jax.objectives.spec import TrainState

BLOCK = 1024
Reward = Callable[[dict[str, Any], str], float]


def load_reward(spec: str) -> Reward:
    """``"module:function"`` -> the function (called as ``function(record, completion_text)``)."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"rl.reward={spec!r}: cannot import {module_name!r} ({err}); check the module path"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl.reward={spec!r}: {module_name} has no function {name!r}")
    return fn


def prompt_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a model is asked to continue: the record's, without a trailing assistant one."""
    messages = record["messages"]
    return messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages


class PromptSet:
    """Training prompts by position (``record(i)``, any i >= 0, epochs reshuffled) and the held-out
    prompts (``held_out``), for ``cfg.rl``."""

    def __init__(self, cfg: Config):
        self.cfg, rl = cfg, cfg.rl
        if rl.prompts == "reverse":
            self._records: list[dict[str, Any]] | None = None
            self.held_out = reverse_chats(rl.eval_prompts, seed=[rl.prompt_seed, 1])
            return
        train, held_out = _read_prompt_file(rl.prompts, cfg.data.held_out_fraction, cfg.data.on_bad_document)
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


def _read_prompt_file(path: str, fraction: float, on_bad: str) -> tuple[list[dict], list[dict]]:
    bad = BadDocuments(on_bad)  # type: ignore[arg-type]
    train, held_out = [], []
    for key, where, record in jsonl_records(path, bad, name="prompts", kind="chat"):
        messages = record.get("messages")
        problem = (
            check_record({**record, "messages": [*messages, {"role": "assistant", "content": ""}]})
            if isinstance(messages, list)
            else f"no 'messages' list (fields: {', '.join(map(repr, record)) or 'none'})"
        )
        if problem is not None:
            bad.report(f"{where}: {problem}", 'write one {"messages": [...]} prompt per line')
            continue
        (held_out if held_out_key(key, fraction) else train).append(record)
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
                raise ConfigError(
                    f"a prompt of {len(ids)} tokens does not fit: train.seq_len - rl.max_new_tokens = {self.width}; "
                    "raise train.seq_len"
                )
            prompts.append(np.asarray(ids, np.int32))
        ids = np.full((len(prompts), self.width), self.tokenizer.pad_id, np.int32)
        mask = np.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, self.width - len(prompt) :], mask[row, self.width - len(prompt) :] = prompt, 1
        return ids, mask, prompts


def completion_texts(tokenizer: Tokenizer, rows: list[list[int]]) -> list[str]:
    """Generated ids -> text, the EOS left out."""
    return [tokenizer.decode([t for t in row if t != tokenizer.eos_id]) for row in rows]


def held_out_reward(
    cfg: Config,
    variables: dict[str, Any],
    tokenizer: Tokenizer,
    records: Sequence[dict[str, Any]],
    reward: Reward,
) -> float:
    """The mean reward of greedy completions (``rl.max_new_tokens``) of ``records``' prompts."""
    encode = PromptEncoder(cfg, tokenizer, cfg.train.seq_len - cfg.rl.max_new_tokens)
    ids, mask, _ = encode(records)
    out = generate(
        cfg.model,
        variables,
        ids,
        attention_mask=mask,
        max_new_tokens=cfg.rl.max_new_tokens,
        stop_tokens=[*cfg.model.stop_token_ids, tokenizer.eos_id],
        vocab_limit=tokenizer.vocab_size,
    )
    texts = completion_texts(tokenizer, out.rows())
    return float(np.mean([reward(r, t) for r, t in zip(records, texts, strict=True)]))


class HeldOutReward:
    """A ``grpo`` run's held-out evaluation: the mean greedy reward of the held-out prompts
    (``eval_reward``; ``eval_loss`` is its negation, so ``checkpoint.keep_best`` keeps the best)."""

    def __init__(
        self, cfg: Config, tokenizer: Tokenizer, prompts: PromptSet, beat: Callable[[int, str], None]
    ):
        self.cfg, self.tokenizer, self.prompts, self.beat = cfg, tokenizer, prompts, beat
        self.reward = load_reward(cfg.rl.reward)

    def __call__(self, step: int, state: TrainState) -> dict[str, float]:
        self.beat(step, "eval")
        variables = {"params": state.params, "balancing": state.balancing}
        mean = held_out_reward(self.cfg, variables, self.tokenizer, self.prompts.held_out, self.reward)
        return {"loss": -mean, "reward": mean}
