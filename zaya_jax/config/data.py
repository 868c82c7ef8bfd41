"""The ``data`` section: the sources of the mixture and how their text becomes token rows."""

from __future__ import annotations

import dataclasses
from typing import Literal

from zaya_jax.config.errors import ConfigError

BUILT_IN = ("stdlib", "passkey")  # kinds whose documents come with zaya-jax (no path)


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One input of the data mixture.

    ``kind``: ``stdlib`` (the built-in corpus: the running interpreter's standard-library source;
    ``path`` unused), ``passkey`` (built-in synthetic long-context documents: a pass key hidden in
    filler text and asked for at the end, 112 to 2,048 characters, :mod:`zaya_jax.data.passkey`;
    ``path`` unused), ``text`` (a file, directory or glob of UTF-8 text files, one document per
    file), ``jsonl`` (one document per line, field ``text_field``), ``parquet`` (column
    ``text_field``), ``chat`` (JSONL conversations, one ``{"messages": [...]}`` per line, rendered
    with the tokenizer's chat template and trained on the assistant turns only; see
    :mod:`zaya_jax.data.chat`), ``preference`` (JSONL pairs ``{"prompt" or "messages", "chosen",
    "rejected"}`` for ``train.objective`` dpo, ipo or simpo; see :mod:`zaya_jax.data.preference`) or
    ``arrayrecord`` (a directory written by ``zaya data prepare``).
    """

    name: str = "stdlib"  # unique name (events, mixture order)
    # stdlib, passkey, text, jsonl, parquet, chat, preference or arrayrecord (see above).
    kind: Literal["stdlib", "passkey", "text", "jsonl", "parquet", "chat", "preference", "arrayrecord"] = (
        "stdlib"
    )
    path: str | None = None  # file, directory or glob (unused for stdlib and passkey)
    weight: float = 1.0  # sampling weight in the mixture
    text_field: str = "text"  # JSONL field / Parquet column holding the text
    # chat, preference: a Jinja chat-template file; unset: the tokenizer's own (chat_template.jinja beside
    # tokenizer.json, or tokenizer_config.json's chat_template; the byte tokenizer's built-in one).
    chat_template: str | None = None


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it becomes token rows."""

    sources: tuple[DataSource, ...] = (DataSource(),)  # the inputs of the mixture (see below)
    # "byte" (no download; ids 0/1/2 = pad/eos/bos, byte b -> b + 3), a path to an HF tokenizer.json, or
    # "none" (a model converted without one: give one to train, evaluate text or generate from text).
    tokenizer: str = "byte"
    held_out_fraction: float = 0.02  # documents held out for evaluation (by hashed key)
    # "error": an unreadable or undecodable document stops the run naming the file; "skip": counted.
    on_bad_document: Literal["error", "skip"] = "error"
    prefetch: int = 2  # batches prepared ahead of the step on a background thread
    # Training rows are shuffled within windows of this many packed rows (Grain's window shuffle),
    # so a batch mixes many documents instead of consecutive pieces of one; 0 or 1: packing order.
    # A source whose size is known (a JSONL, chat or preference file) gets a window of at most one
    # pass of its rows, so a small file is not read thousands of times before the first batch.
    shuffle_window: int = 4096
    # Every batch is read from this many row streams (documents k::streams), so a run resumes on any
    # number of processes with the same rows; 0: the largest power of two <= 8 dividing every batch
    # size (zaya_jax/data/streams.py). Set it to a multiple of the process counts you launch on.
    streams: int = 0

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError(
                "data.sources is empty; list at least one source (e.g. {name: stdlib, kind: stdlib})"
            )
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"data.sources names must be unique, got {names}")
        for i, source in enumerate(self.sources):
            if source.kind not in BUILT_IN and not source.path:
                raise ConfigError(f"data.sources[{i}] ({source.name}) of kind {source.kind!r} needs a path")
            if not source.weight > 0:
                raise ConfigError(f"data.sources[{i}].weight={source.weight} must be > 0")
            if source.chat_template and source.kind not in ("chat", "preference"):
                raise ConfigError(
                    f"data.sources[{i}] ({source.name}) sets chat_template but is of kind {source.kind!r}; "
                    "chat templates apply to kinds chat and preference (a prepared chat directory names its own)"
                )
        if not 0.0 < self.held_out_fraction < 0.5:
            raise ConfigError(f"data.held_out_fraction={self.held_out_fraction} must be in (0, 0.5)")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch} must be >= 0")
        if self.shuffle_window < 0:
            raise ConfigError(f"data.shuffle_window={self.shuffle_window} must be >= 0 (0: no row shuffle)")
        if self.streams < 0:
            raise ConfigError(f"data.streams={self.streams} must be >= 0 (0: automatic)")
