"""The reference log-probabilities of a DPO or IPO run: every preference pair's chosen and rejected
completion scored once by the starting weights (``train.init_from`` or the fresh initialisation),
before step 1, and stored with the run, so no second model is held in memory through training.

Stored as ``<run>/reference/logps.npz`` (per source, a (pairs, 2) float32 array in the source's
document order; NaN for a pair longer than ``train.seq_len``, which training leaves out too) and
``<run>/reference/manifest.json`` (what they were computed from). A resumed run reads them back;
one whose data no longer matches is refused, and one whose stored values are damaged or gone
computes them again from its starting weights when these still have the fingerprint the first pass
recorded (:func:`checked_starting_weights`), else it is refused. The dpo and ipo specs (:mod:`.preference`) run this
as their ``prepare`` part (and ``zaya eval RUN --data PAIRS.jsonl`` scores new pairs with it,
:mod:`.pair_files`); simpo needs no reference. Every process computes the same values (the pass is a
forward over the whole set, each process feeding its rows of every batch); process 0 writes them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zaya_jax.checkpoint.fingerprint import digest
from zaya_jax.config import Config, ConfigError, DataConfig
from zaya_jax.data import DataError, make_row_iterator, tokenized_documents
from zaya_jax.data.documents import DocumentSequence
from zaya_jax.data.packing import pair_fits
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.files import EVENTS, write_atomic
from zaya_jax.objectives.spec import RunSetup, SavedRun
from zaya_jax.parallel import local_rows, put_batch
from zaya_jax.programs import Programs, TrainState

REFERENCE = "reference"


def _source_data(cfg: Config, index: int) -> DataConfig:
    return dataclasses.replace(cfg.data, sources=(cfg.data.sources[index],))


def _describe(cfg: Config, tokenizer: Tokenizer) -> dict[str, Any]:
    """What the reference values depend on: each source's pairs and the longest row."""
    sources = {}
    for i, source in enumerate(cfg.data.sources):
        documents = tokenized_documents(_source_data(cfg, i), "all", tokenizer)[0]
        sources[source.name] = {"pairs": len(documents.documents), "fingerprint": documents.fingerprint}
    return {"seq_len": cfg.train.max_seq_len, "tokenizer": tokenizer.spec, "sources": sources}


def row_batches(rows: Iterator[dict[str, np.ndarray]], size: int) -> Iterator[dict[str, np.ndarray]]:
    """Rows in order, ``size`` at a time, the last batch filled with empty rows."""
    while True:
        taken = [row for _, row in zip(range(size), rows, strict=False)]
        if not taken:
            return
        taken += [{k: np.zeros_like(v) for k, v in taken[0].items()}] * (size - len(taken))
        yield {k: np.stack([row[k] for row in taken]) for k in taken[0]}


def pairs_fitting(documents: DocumentSequence, seq_len: int) -> np.ndarray:
    """(pairs,) bool: which pair documents fit in a row of ``seq_len`` (the others are left out)."""
    return np.fromiter(
        (pair_fits(documents[j], seq_len) for j in range(len(documents))), bool, len(documents)
    )


def refuse_sources_that_never_fit(cfg: Config, tokenizer: Tokenizer) -> None:
    """Before step 1 of a preference run: a source none of whose pairs fits a row of
    ``train.max_seq_len`` tokens is refused by name (training would leave out every pair it reads;
    the packer stops such a stream too, :mod:`zaya_jax.data.packing`, but only once it has read a
    whole pass)."""
    seq_len = cfg.train.max_seq_len
    for i, source in enumerate(cfg.data.sources):
        documents = tokenized_documents(_source_data(cfg, i), "all", tokenizer)[0].documents
        if len(documents) and not pairs_fitting(documents, seq_len).any():
            raise DataError(
                f"every preference pair of {source.name!r} ({source.path}) is longer than a row of {seq_len} "
                "tokens (chosen and rejected together, each with EOS); raise train.seq_len or drop the source"
            )


def score_pairs(
    cfg: Config,
    programs: Programs,
    state: TrainState,
    tokenizer: Tokenizer,
    on_batch: Callable[[], None] = lambda: None,
) -> dict[str, np.ndarray]:
    """Per preference source, the (pairs, 2) log-probabilities of every pair's chosen and rejected
    completion under ``state``'s weights (NaN for pairs longer than a row); ``on_batch()`` after
    every batch (the watchdog's beat)."""
    seq_len, step = cfg.train.max_seq_len, programs.sequence_logps_step
    out = {}
    for i, source in enumerate(cfg.data.sources):
        data = _source_data(cfg, i)
        documents = tokenized_documents(data, "all", tokenizer)[0].documents
        fits = pairs_fitting(documents, seq_len)
        rows = make_row_iterator(
            data, tokenizer, seq_len=seq_len, seed=0, split="all", shuffle=False, repeat=False
        )
        values = []
        for batch in row_batches(rows, cfg.train.batch_size):
            per_segment = np.asarray(
                step(state.params, state.balancing, put_batch(local_rows(batch), programs.layout.batch))
            )
            on_batch()
            for r, segments in enumerate(batch["segment_ids"]):
                pairs = int(segments.max()) // 2
                values.append(per_segment[r, 1 : 2 * pairs + 1].reshape(pairs, 2))
        scored = np.concatenate(values) if values else np.zeros((0, 2), np.float32)
        if len(scored) != fits.sum():  # the packer and pair_fits disagree: a bug, never silent
            raise RuntimeError(f"scored {len(scored)} pairs of {source.name!r} but {fits.sum()} fit a row")
        reference = np.full((len(documents), 2), np.nan, np.float32)
        reference[fits] = scored
        out[source.name] = reference
    return out


def _write(directory: Path, references: dict[str, np.ndarray], manifest: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **{str(i): references[name] for i, name in enumerate(manifest["sources"])})
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / "logps.npz", buffer.getvalue())
    write_atomic(
        directory / "manifest.json", json.dumps(manifest, indent=2) + "\n"
    )  # last: marks it complete


class _Unreadable(Exception):
    """The stored reference values are damaged or gone (recoverable from the starting weights)."""


def _read(directory: Path, expected: dict[str, Any]) -> dict[str, np.ndarray]:
    """The stored values, checked against what this run would compute them from; damage is
    :class:`_Unreadable`, other data a :class:`ConfigError`."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        with np.load(directory / "logps.npz") as arrays:
            values = {name: np.asarray(arrays[str(i)]) for i, name in enumerate(manifest["sources"])}
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
        raise _Unreadable(f"cannot read {directory} ({type(err).__name__}: {err})") from None
    recorded = {k: manifest.get(k) for k in expected if k != "computed_from"}
    wanted = {k: v for k, v in expected.items() if k != "computed_from"}
    if recorded != wanted:
        raise ConfigError(
            f"the reference log-probabilities in {directory} were computed for {recorded}, but this run has "
            f"{wanted}: the preference data, tokenizer or train.seq_len changed; restore them or start a new run"
        )
    for name, source in expected["sources"].items():
        if values[name].shape != (source["pairs"], 2):
            raise _Unreadable(
                f"{directory} holds {values[name].shape} values for the {source['pairs']} pairs of {name!r}"
            )
    return values


def weights_fingerprint(state: TrainState) -> str:
    """A short hash of the parameters' and balancing biases' array fingerprints."""
    return digest({"params": state.params, "balancing": state.balancing})


def _recorded_weights(run_dir: Path) -> str | None:
    """The starting weights' fingerprint the run's last ``reference`` event recorded."""
    found = None
    try:
        lines = (run_dir / EVENTS).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "reference":
            found = (event.get("detail") or {}).get("weights", found)
    return found


def _compute(
    setup: RunSetup, state: TrainState, expected: dict[str, Any], recomputed: bool
) -> dict[str, np.ndarray]:
    """Every pair scored by ``state`` (the starting weights), written to ``<run>/reference/``."""
    cfg = setup.cfg
    started = time.perf_counter()
    if jax.process_index() == 0:
        pairs = sum(s["pairs"] for s in expected["sources"].values())
        print(f"zaya train: scoring {pairs} preference pairs with the starting weights...", file=sys.stderr)
    references = score_pairs(cfg, setup.programs, state, setup.tokenizer, lambda: setup.beat(0, "reference"))
    too_long = {name: int(np.isnan(v[:, 0]).sum()) for name, v in references.items()}
    weights = weights_fingerprint(state)
    computed_from = cfg.train.init_from or f"initialisation, train.seed={cfg.train.seed}"
    if jax.process_index() == 0:
        _write(
            setup.run_dir / REFERENCE,
            references,
            {**expected, "computed_from": computed_from, "weights": weights},
        )
    setup.event(
        "reference",
        pairs={k: s["pairs"] for k, s in expected["sources"].items()},
        too_long=too_long,
        seconds=round(time.perf_counter() - started, 3),
        weights=weights,
        **({"recomputed": True} if recomputed else {}),
    )
    return references


def preference_references(setup: RunSetup) -> dict[str, np.ndarray]:
    """The run's reference log-probabilities: read from ``<run>/reference/``, or computed from
    ``setup.state`` (the starting weights) when the run starts from step 1 without them; the pass
    is recorded as a ``reference`` event with the starting weights' fingerprint.

    A resumed run whose stored values are damaged or gone computes them again from its starting
    weights (``train.init_from``, or the initialisation of ``train.seed``) when those still have the
    fingerprint the run recorded; otherwise it is refused, naming what to restore."""
    directory = setup.run_dir / REFERENCE
    expected = _describe(setup.cfg, setup.tokenizer)
    stored = (directory / "manifest.json").is_file()
    try:
        if stored:
            return _read(directory, expected)
        problem = f"{directory} is missing"
    except _Unreadable as err:
        problem = str(err)
    if setup.fresh_start:
        return _compute(setup, setup.state, expected, recomputed=stored)
    starting = checked_starting_weights(
        setup.run_dir,
        setup.cfg,
        setup.starting_weights,
        f"the run's reference log-probabilities cannot be used ({problem})",
        "restore them or start a new run (another run.name)",
    )
    print(f"zaya train: {problem}; computing the reference log-probabilities again", file=sys.stderr)
    return _compute(setup, starting, expected, recomputed=True)


def checked_starting_weights(
    run_dir: Path, cfg: Config, load: Callable[[], TrainState], needed: str, fix: str
) -> TrainState:
    """The run's starting weights (``load()``: ``train.init_from``'s or the initialisation of
    ``train.seed``) when they have the fingerprint its reference pass recorded; otherwise a
    :class:`ConfigError` of one line: ``needed`` (what wants them), what is wrong, ``fix``."""
    origin = cfg.train.init_from or f"the initialisation of train.seed={cfg.train.seed}"
    recorded = _recorded_weights(run_dir)
    if recorded is None:
        raise ConfigError(
            f"{needed}, and {run_dir / EVENTS} records no fingerprint of the run's starting weights to "
            f"check them against: {fix}"
        )
    try:
        starting = load()
    except OSError as err:
        raise ConfigError(
            f"{needed}, and its starting weights ({origin}) cannot be read ({err}): {fix}"
        ) from None
    if weights_fingerprint(starting) != recorded:
        raise ConfigError(
            f"{needed}, and its starting weights ({origin}) are not the ones they were computed from "
            f"(another fingerprint): {fix}"
        )
    return starting


def read_references(saved: SavedRun) -> dict[str, np.ndarray]:
    """A finished or running dpo/ipo run's stored reference log-probabilities, checked against its
    data (``zaya eval`` of the run)."""
    directory = Path(saved.run_dir) / REFERENCE
    if not (directory / "manifest.json").is_file():
        raise ConfigError(
            f"{saved.run_dir} is a {saved.cfg.train.objective} run without its reference log-probabilities "
            f"({directory}); evaluate the run directory itself (not a copied checkpoint), or give --data"
        )
    try:
        return _read(directory, _describe(saved.cfg, saved.tokenizer))
    except _Unreadable as err:
        raise ConfigError(
            f"{err}; resume the run (zaya train) to compute the reference log-probabilities again from its "
            "starting weights, or evaluate with --data"
        ) from None
