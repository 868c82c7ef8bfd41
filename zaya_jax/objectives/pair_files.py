"""``zaya eval RUN --data PAIRS.jsonl`` of a dpo, ipo or simpo run: the given preference pairs scored
by the run's own loss, reported as its held-out evaluation is (loss per pair, ``pair_accuracy``,
the rewards and log-probabilities, ``pairs``; :func:`~.held_out.loss_over`).

Every JSONL file is read as training reads its preference sources (the same reader and checks: a
record that is not a good pair is an error naming its file and line, or skipped and counted under
``data.on_bad_document: skip``); a pair longer than a row is left out and counted, and a file none
of whose pairs fits a row is refused. dpo and ipo score the pairs' reference log-probabilities with
the run's starting weights, by the pass training runs before step 1 (:func:`.reference.score_pairs`),
once those weights have the fingerprint the run recorded (:func:`.reference.checked_starting_weights`,
as a resumed run recomputing lost scores checks them); simpo needs no reference."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from zaya_jax.config import Config, ConfigError
from zaya_jax.data import DataError, make_row_iterator, tokenized_documents
from zaya_jax.data.documents import SourceDocuments
from zaya_jax.objectives.held_out import loss_over
from zaya_jax.objectives.reference import checked_starting_weights, pairs_fitting, row_batches, score_pairs
from zaya_jax.objectives.spec import GivenData, SavedRun, spec_for
from zaya_jax.programs import single_device_programs

_PAIR_RECORD = 'one {"prompt", "chosen", "rejected"} object per line'
_JSONL = ("preference", "jsonl", "chat")  # the kinds zaya_jax.data.sources.source_for_path gives a JSONL file


def _pair_config(saved: SavedRun, given: GivenData) -> Config:
    """The run's config reading ``given``'s files in rows of ``--seq-len`` (default ``train.seq_len``)
    and batches of ``--batch-size`` (default ``train.batch_size``), with the run's data settings."""
    others = [s.path for s in given.sources if s.kind not in _JSONL]
    if others:
        raise ConfigError(
            f"{', '.join(others)}: not JSONL; --data of a {saved.cfg.train.objective} run scores preference pairs "
            f"by its loss: give JSONL files of {_PAIR_RECORD} (for the next-token loss of text, export the "
            "model, zaya convert zaya-to-hf RUN DIR, and evaluate DIR)"
        )
    # Every JSONL file is read as pairs, so a record that is not one is named with its line.
    sources = tuple(dataclasses.replace(s, kind="preference") for s in given.sources)
    cfg = saved.cfg
    train = dataclasses.replace(
        cfg.train,
        seq_len=given.seq_len or cfg.train.seq_len,
        batch_size=given.batch_size or cfg.train.batch_size,
        batch_ramp=(),
        stages=(),
    )
    data = dataclasses.replace(cfg.data, sources=sources)
    return dataclasses.replace(cfg, model=saved.model.config, data=data, train=train)


def _usable(cfg: Config, sources: list[SourceDocuments]) -> dict[str, int]:
    """Per source, how many of its pairs are longer than a row (left out); a source none of whose
    pairs fits is refused."""
    seq_len, too_long = cfg.train.seq_len, {}
    for source in sources:
        fits = int(pairs_fitting(source.documents, seq_len).sum())
        if fits == 0:
            raise DataError(
                f"no pair of {source.name} fits a row of {seq_len} tokens (chosen and rejected together, each "
                f"with EOS; {len(source.documents)} pairs are longer): raise --seq-len or leave the file out"
            )
        too_long[source.name] = len(source.documents) - fits
    return too_long


def _starting_references(saved: SavedRun, cfg: Config) -> dict[str, np.ndarray]:
    """The reference log-probabilities of every pair of ``cfg``'s sources under the run's starting
    weights, checked against the fingerprint the run recorded."""
    init_from = cfg.train.init_from
    needed = (
        f"scoring {', '.join(s.path for s in cfg.data.sources)} by the run's {cfg.train.objective} loss needs "
        "reference log-probabilities from the weights the run started from"
    )
    fix = "evaluate the run directory itself (its events.jsonl records their fingerprint)" + (
        f" with the weights it started from back at train.init_from={init_from}"
        if init_from
        else " on the kind of machine, with the jax version and XLA flags, that trained it (the "
        "initialisation of train.seed is bit-identical only there)"
    )
    load = saved.starting_weights
    if load is None:
        raise ConfigError(f"{needed}, and none were given (SavedRun.starting_weights): {fix}")
    programs = single_device_programs(cfg, spec_for(cfg).loss)
    starting = checked_starting_weights(saved.run_dir, cfg, lambda: load(programs), needed, fix)
    return score_pairs(cfg, programs, starting, saved.tokenizer)


def _describe(
    saved: SavedRun,
    cfg: Config,
    sources: list[SourceDocuments],
    too_long: dict[str, int],
    references: bool,
    given: GivenData,
) -> str:
    """What was evaluated, in words (the line ``zaya eval`` prints)."""
    train = cfg.train
    start = train.init_from or f"the initialisation of train.seed={train.seed}"
    against = f", against reference log-probabilities of its starting weights ({start})" if references else ""
    limit = f" (at most {given.max_batches} batches)" if given.max_batches else ""
    what = (
        f"{', '.join(s.path for s in cfg.data.sources)}: preference pairs scored by the run's {train.objective} "
        f"loss (step {saved.step}){against}, in batches of {train.batch_size} x {train.seq_len} tokens{limit}"
    )
    left_out = [f"{n} pair{'s' * (n != 1)} of {name}" for name, n in too_long.items() if n]
    if left_out:
        what += f"; left out as longer than a row of {train.seq_len} tokens: {', '.join(left_out)}"
    skipped = [f"{s.skipped} of {s.name}" for s in sources if s.skipped]
    if skipped:
        what += f"; bad records skipped (data.on_bad_document: skip): {', '.join(skipped)}"
    return what


def pair_file_evaluation(with_reference: bool) -> Callable[[SavedRun, GivenData], dict[str, Any]]:
    """The ``evaluate_data`` part of a preference objective (``with_reference``: dpo and ipo)."""

    def evaluate_data(saved: SavedRun, given: GivenData) -> dict[str, Any]:
        cfg = _pair_config(saved, given)
        sources = tokenized_documents(cfg.data, "all", saved.tokenizer)  # bad records: file and line
        too_long = _usable(cfg, sources)
        references = _starting_references(saved, cfg) if with_reference else None
        rows = make_row_iterator(
            cfg.data, saved.tokenizer, seq_len=cfg.train.seq_len, seed=0, split="all", shuffle=False,
            repeat=False, references=references,
        )  # fmt: skip
        batches: Iterator[dict[str, np.ndarray]] = row_batches(rows, cfg.train.batch_size)
        if given.max_batches:
            batches = itertools.islice(batches, given.max_batches)
        result = loss_over(saved.model, cfg, spec_for(cfg).loss, batches, saved.progress)
        return {**result, "evaluated": _describe(saved, cfg, sources, too_long, with_reference, given)}

    return evaluate_data
