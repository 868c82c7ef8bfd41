"""Preference pairs for DPO, IPO and SimPO: one JSON object per line of a JSONL file (``.gz``/``.zst``
too) holding a prompt and two completions of it, the preferred ``chosen`` and the ``rejected``.

Accepted shapes (TRL's "conversational" and "standard" preference formats):

- ``{"prompt": "text", "chosen": "text", "rejected": "text"}``: the prompt is one user message and
  each completion one assistant message;
- ``{"prompt": [messages] or "messages": [messages], "chosen": ..., "rejected": ...}``: the prompt
  is a conversation (roles as in :mod:`zaya_jax.data.chat`, ending before the reply), and each
  completion a string, one assistant message ``{"role": "assistant", "content": ...}``, or a list
  of messages (assistant and tool turns);
- an optional ``tools`` list, as for chat.

Both sequences are rendered with the tokenizer's chat template (:class:`~zaya_jax.data.chat.ChatEncoder`,
so the byte tokenizer's built-in one or ``chat_template``) and only the completion's assistant
tokens are scored: earlier assistant turns of the prompt are context.

A pair document is a (3, n) int32 array: token ids, 1 on the scored tokens, and which sequence each
token belongs to (1 chosen, 2 rejected); the packer keeps a pair in one row, chosen first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zaya_jax.config import DataSource
from zaya_jax.data.chat import (
    ChatDocuments,
    ChatEncoder,
    check_record,
    find_chat_template_for,
    read_encoded,
)
from zaya_jax.data.tokenizers import Tokenizer

CHOSEN, REJECTED = 1, 2
_FIX_RECORD = 'write one {"prompt": "..." or [messages], "chosen": "..." or [messages], "rejected": ...} object per line'


def _completion(value: Any) -> list[dict[str, Any]] | None:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}] if value else None
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and value:
        return value
    return None


def split_record(record: dict[str, Any]) -> tuple[list[dict[str, Any]], list, list] | str:
    """(prompt messages, chosen messages, rejected messages) of a preference record, or what is
    wrong with it."""
    prompt = record.get("prompt", record.get("messages"))
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        fields = ", ".join(map(repr, record)) or "none"
        return f"no prompt: give 'prompt' (a string or a list of messages) or 'messages' (fields: {fields})"
    if isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant":
        return "the prompt ends with an assistant message; it ends before the reply: put the reply in 'chosen' and 'rejected'"
    completions = []
    for side in ("chosen", "rejected"):
        messages = _completion(record.get(side))
        if messages is None:
            return f"'{side}' is missing or empty; give a string, an assistant message or a list of messages"
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
            return f"'{side}' has no assistant message: nothing in it would be scored"
        problem = check_record({"messages": prompt + messages, "tools": record.get("tools")})
        if problem is not None:
            return f"{side}: {problem}"
        completions.append(messages)
    if completions[0] == completions[1]:
        return "'chosen' and 'rejected' are the same: the pair prefers nothing"
    return prompt, completions[0], completions[1]


class PreferenceEncoder:
    """Renders preference records with a chat template into (3, n) pair documents."""

    def __init__(self, encoder: ChatEncoder):
        self.encoder = encoder

    def _sequence(self, prompt: list, completion: list, tools: list[dict[str, Any]] | None) -> np.ndarray:
        replies = sum(1 for m in completion if m.get("role") == "assistant")
        return self.encoder.encode({"messages": prompt + completion, "tools": tools}, last_turns=replies)

    def encode(self, record: dict[str, Any]) -> np.ndarray:
        """A preference record -> (3, n) int32 [ids; scored; 1 chosen / 2 rejected]. Raises
        ValueError with what is wrong."""
        parts = split_record(record)
        if isinstance(parts, str):
            raise ValueError(parts)
        prompt, chosen, rejected = parts
        tools = record.get("tools")
        pieces = [self._sequence(prompt, chosen, tools), self._sequence(prompt, rejected, tools)]
        which = [
            np.full(p.shape[1], side, np.int32) for p, side in zip(pieces, (CHOSEN, REJECTED), strict=True)
        ]
        return np.concatenate([np.concatenate(pieces, axis=1), np.concatenate(which)[None]])


def read_preference_documents(
    source: DataSource, tokenizer: Tokenizer, on_bad_document: str
) -> ChatDocuments:
    """Every pair of the preference ``source`` as (3, n) documents; a bad record is an error naming
    its file and line, or skipped and counted (:func:`~zaya_jax.data.chat.iter_encoded`)."""
    encoder = PreferenceEncoder(ChatEncoder(tokenizer, find_chat_template_for(source, tokenizer)))
    return read_encoded(source, encoder.encode, on_bad_document, _FIX_RECORD, "pairs")


def pair_lengths(document: np.ndarray) -> tuple[int, int]:
    """(chosen, rejected) token counts of a (3, n) pair document."""
    which = document[2]
    return int((which == CHOSEN).sum()), int((which == REJECTED).sum())
