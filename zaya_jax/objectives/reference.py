"""The reference log-probabilities of a DPO or IPO run: every preference pair's chosen and rejected
completion scored once by the starting weights (``train.init_from`` or the fresh initialisation),
before step 1, and stored with the run, so no second model is held in memory through training.

Stored as ``<run>/reference/logps.npz`` (per source, a (pairs, 2) float32 array in the source's
document order; NaN for a pair longer than ``train.seq_len``, which training leaves out too) and
``<run>/reference/manifest.json`` (what they were computed from). A resumed run reads them back;
one whose data no longer matches is refused, and a run with checkpoints but no reference directory
is refused (its starting weights are gone). The dpo and ipo specs (:mod:`.preference`) run this
as their ``prepare`` part; simpo needs no reference. Every process computes the same values (the pass is a
forward over the whole set, each process feeding its rows of every batch); process 0 writes them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zaya_jax.config import Config, ConfigError, DataConfig
from zaya_jax.data import make_row_iterator, tokenized_documents
from zaya_jax.data.packing import pair_fits
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.files import write_atomic
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


def _batches(rows: Iterator[dict[str, np.ndarray]], size: int) -> Iterator[dict[str, np.ndarray]]:
    """Rows in order, ``size`` at a time, the last batch filled with empty rows."""
    while True:
        taken = [row for _, row in zip(range(size), rows, strict=False)]
        if not taken:
            return
        taken += [{k: np.zeros_like(v) for k, v in taken[0].items()}] * (size - len(taken))
        yield {k: np.stack([row[k] for row in taken]) for k in taken[0]}


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
        fits = np.fromiter((pair_fits(documents[j], seq_len) for j in range(len(documents))), bool)
        rows = make_row_iterator(
            data, tokenizer, seq_len=seq_len, seed=0, split="all", shuffle=False, repeat=False
        )
        values = []
        for batch in _batches(rows, cfg.train.batch_size):
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


def _read(directory: Path, expected: dict[str, Any]) -> dict[str, np.ndarray]:
    manifest_path = directory / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        with np.load(directory / "logps.npz") as arrays:
            values = {name: arrays[str(i)] for i, name in enumerate(manifest["sources"])}
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(
            f"cannot read the run's reference log-probabilities in {directory} ({err}); they come from the "
            "starting weights: start a new run (another run.name) to compute them again"
        ) from None
    recorded = {k: manifest.get(k) for k in expected if k != "computed_from"}
    wanted = {k: v for k, v in expected.items() if k != "computed_from"}
    if recorded != wanted:
        raise ConfigError(
            f"the reference log-probabilities in {directory} were computed for {recorded}, but this run has "
            f"{wanted}: the preference data, tokenizer or train.seq_len changed; restore them or start a new run"
        )
    return values


def preference_references(setup: RunSetup) -> dict[str, np.ndarray]:
    """The run's reference log-probabilities: read from ``<run>/reference/``, or computed from
    ``setup.state`` (the starting weights) when the run starts from step 1 without them; the pass
    is recorded as a ``reference`` event, the watchdog beaten after each of its batches."""
    cfg, run_dir, tokenizer = setup.cfg, setup.run_dir, setup.tokenizer
    directory = run_dir / REFERENCE
    expected = _describe(cfg, tokenizer)
    if (directory / "manifest.json").is_file():
        return _read(directory, expected)
    if not setup.fresh_start:
        raise ConfigError(
            f"{run_dir} has checkpoints but no reference log-probabilities ({directory}); they come from the "
            "starting weights, which are gone: start a new run (another run.name)"
        )
    started = time.perf_counter()
    if jax.process_index() == 0:
        pairs = sum(s["pairs"] for s in expected["sources"].values())
        print(f"zaya train: scoring {pairs} preference pairs with the starting weights...", file=sys.stderr)
    references = score_pairs(cfg, setup.programs, setup.state, tokenizer, lambda: setup.beat(0, "reference"))
    too_long = {name: int(np.isnan(v[:, 0]).sum()) for name, v in references.items()}
    if all(too_long[name] == s["pairs"] for name, s in expected["sources"].items()):
        raise ConfigError(
            f"every preference pair is longer than train.seq_len={cfg.train.max_seq_len} tokens (chosen and "
            "rejected together, each with EOS); raise train.seq_len"
        )
    manifest = {
        **expected,
        "computed_from": cfg.train.init_from or f"initialisation, train.seed={cfg.train.seed}",
    }
    if jax.process_index() == 0:
        _write(directory, references, manifest)
    seconds = round(time.perf_counter() - started, 3)
    setup.event(
        "reference",
        pairs={k: s["pairs"] for k, s in expected["sources"].items()},
        too_long=too_long,
        seconds=seconds,
    )
    return references


def read_references(saved: SavedRun) -> dict[str, np.ndarray]:
    """A finished or running dpo/ipo run's stored reference log-probabilities, checked against its
    data (``zaya eval`` of the run)."""
    directory = Path(saved.run_dir) / REFERENCE
    if not (directory / "manifest.json").is_file():
        raise ConfigError(
            f"{saved.run_dir} is a {saved.cfg.train.objective} run without its reference log-probabilities "
            f"({directory}); evaluate the run directory itself (not a copied checkpoint), or give --data"
        )
    return _read(directory, _describe(saved.cfg, saved.tokenizer))
