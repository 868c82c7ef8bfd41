"""Corpus preparation (``zaya data prepare``): tokenize documents once into ArrayRecord shards and
their manifest, in the format of :mod:`.format`.

The whole directory is written beside the destination and renamed into place when complete
(:mod:`zaya_jax.staging`): a killed preparation leaves no output directory (only a hidden
``.<name>.partial`` that the next run of the same command removes, and its finished work, which
that run keeps: :mod:`.work` spreads the work over hosts and worker processes and resumes it), and
the manifest is written last, so a directory without ``manifest.json`` is never read. A rerun of a
preparation that had finished prepares again and succeeds when the result is byte-identical to what
is there (the manifest holds no time or other varying field), and refuses otherwise.

Training never imports this module: it reads prepared data through :mod:`.reader`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zaya_jax.config import DataSource
from zaya_jax.data.chat import ChatEncoder, find_chat_template_for
from zaya_jax.data.prepared.format import MANIFEST, manifest_of, shard_name
from zaya_jax.data.prepared.reader import read_manifest, verify_shards
from zaya_jax.data.prepared.work import (
    CHUNK_BYTES,
    Job,
    Workers,
    open_work,
    piece_stats,
    plan_of,
    plan_units,
    source_totals,
    wait_for_pieces,
    write_piece,
    write_shard,
)
from zaya_jax.data.sources import DataError, OnBadDocument, source_for_path
from zaya_jax.data.tokenizers import Tokenizer, load_tokenizer, token_dtype
from zaya_jax.files import write_atomic
from zaya_jax.staging import StagedDirectory, StagingError, is_empty_dir, same_files


def _check_out_dir(out: Path) -> None:
    """Refuse anything but a new directory, an empty one, or an earlier complete preparation (whose
    bytes must then match this one's; see :func:`prepare`)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"output directory {out} is a file; give a new directory for the prepared shards")
    if not is_empty_dir(out) and not (out / MANIFEST).is_file():
        raise DataError(
            f"output directory {out} already exists and is not empty; prepare never overwrites data: "
            "choose a new directory or delete this one"
        )


def _refuse_pairs(sources: Sequence[DataSource]) -> None:
    pairs = [s.path for s in sources if s.kind == "preference"]
    if pairs:
        raise DataError(
            f"{', '.join(pairs)} hold preference pairs, which are not prepared: dpo, ipo and simpo read them "
            "as they are (data.sources: [{kind: preference, path: PAIRS.jsonl}])"
        )


def prepare(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer_spec: str = "byte",
    num_shards: int = 4,
    on_bad_document: OnBadDocument = "error",
    text_field: str = "text",
    data_format: str = "auto",
    chat_template: str | None = None,
    *,
    workers: int = 1,
    num_hosts: int = 1,
    host_index: int = 0,
    unit_bytes: int = CHUNK_BYTES,
    wait_s: float = 24 * 3600.0,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Tokenize the documents of ``inputs`` into ``num_shards`` ArrayRecord shards in ``out_dir``.

    ``inputs``: text files, directories (every file a document) or globs, ``*.jsonl`` files (field
    ``text_field``) and ``*.parquet`` files (column ``text_field``); the kind follows the extension,
    and text and JSONL files may be ``.gz`` or ``.zst`` compressed. ``data_format="chat"`` (or
    ``"auto"`` with JSONL records holding ``messages``) reads conversations instead, rendered with
    ``chat_template`` (a file) or the tokenizer's template; one preparation holds text or chats, not
    both. Returns the manifest (also written to ``out_dir/manifest.json``).

    ``workers`` processes tokenize on this host; ``num_hosts`` hosts may share the work, each
    running this with its ``host_index`` (:mod:`.work`): host 0 waits up to
    ``wait_s`` for the others, writes the shards and returns the manifest, the others return
    ``{"host_index", "units"}`` once their part is done. Work is cut into units of a file, or of
    ``unit_bytes`` of a large JSONL file. The output is byte-identical whatever the split, and a killed preparation rerun with the same command redoes only unfinished work.
    ``progress(what, done, total)`` is called as units and shards finish.

    ``out_dir`` appears complete or not at all (see the module doc). When ``out_dir`` already holds
    a finished preparation, it is prepared again beside it: a byte-identical result leaves it as it
    is and succeeds; a different one is refused.
    """
    _check_arguments(inputs, num_shards, workers, num_hosts, host_index)
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = token_dtype(tokenizer.vocab_size).newbyteorder("<")
    out = Path(out_dir)
    sources = [source_for_path(item, text_field=text_field, data_format=data_format) for item in inputs]
    _refuse_pairs(sources)
    sources = [dataclasses.replace(s, chat_template=chat_template) for s in sources]
    encoder = _chat_encoder(sources, tokenizer)
    settings = {
        "tokenizer": tokenizer.spec,
        "num_shards": num_shards,
        "on_bad_document": on_bad_document,
        "template": encoder.template.sha256 if encoder else None,
    }
    units = plan_units(sources, unit_bytes)
    report = progress or (lambda what, done, total: None)
    if host_index != 0:
        work = open_work(out, plan_of(sources, units, settings), primary=False)
        job = Job(sources, units, num_shards, dtype.name, on_bad_document, work)
        mine = [(i,) for i in range(host_index, len(units), num_hosts)]
        with Workers(job, functools.partial(_tools, tokenizer_spec, sources), workers) as pool:
            pool.map(write_piece, mine, lambda d, t: report("units", d, t))
        return {"host_index": host_index, "units": len(mine)}
    _check_out_dir(out)
    try:
        with StagedDirectory(out, "zaya data prepare") as staged:
            work = open_work(out, plan_of(sources, units, settings), primary=True)
            job = Job(sources, units, num_shards, dtype.name, on_bad_document, work)
            try:
                tools = functools.partial(_tools, tokenizer_spec, sources)
                manifest = _prepare_primary(
                    job, staged.path, tools, tokenizer, workers, num_hosts, wait_s, report
                )
                if not staged.publish_or_match(same_files):
                    verify_shards(out, read_manifest(out))
            except Exception:
                if num_hosts == 1:  # a failure, not a kill: nothing to resume (the inputs must change)
                    shutil.rmtree(work, ignore_errors=True)
                raise
            shutil.rmtree(work, ignore_errors=True)
    except StagingError as err:
        raise DataError(str(err)) from None
    return manifest


def _check_arguments(
    inputs: Sequence[Any], num_shards: int, workers: int, num_hosts: int, host_index: int
) -> None:
    if not inputs:
        raise DataError("no inputs given; name the text, JSONL or Parquet files (or directories) to prepare")
    for name, value in (("num_shards", num_shards), ("workers", workers), ("num_hosts", num_hosts)):
        if value < 1:
            raise DataError(f"{name}={value} must be >= 1")
    if not 0 <= host_index < num_hosts:
        raise DataError(f"host_index={host_index} must be in [0, num_hosts={num_hosts})")


def _tools(tokenizer_spec: str, sources: Sequence[DataSource]) -> tuple[Tokenizer, ChatEncoder | None]:
    """A worker's tokenizer and chat encoder (built in the worker: neither is picklable)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    return tokenizer, _chat_encoder(sources, tokenizer)


def _prepare_primary(
    job: Job,
    directory: Path,
    tools: Callable[[], tuple[Tokenizer, ChatEncoder | None]],
    tokenizer: Tokenizer,
    workers: int,
    num_hosts: int,
    wait_s: float,
    report: Callable[[str, int, int], None],
) -> dict[str, Any]:
    """Host 0's part: its units, then (every piece done) the shards, moved into ``directory``
    beside the manifest."""
    encoder = _chat_encoder(job.sources, tokenizer)
    with Workers(job, tools, workers) as pool:
        return _primary_phases(job, directory, pool, tokenizer, encoder, num_hosts, wait_s, report)


def _primary_phases(
    job: Job,
    directory: Path,
    pool: Workers,
    tokenizer: Tokenizer,
    encoder: ChatEncoder | None,
    num_hosts: int,
    wait_s: float,
    report: Callable[[str, int, int], None],
) -> dict[str, Any]:
    mine = [(i,) for i in range(0, len(job.units), num_hosts)]
    pool.map(write_piece, mine, lambda d, t: report("units", d, t))
    if num_hosts > 1:
        wait_for_pieces(job, wait_s, lambda d, t: report("units of all hosts", d, t))
    stats = [piece_stats(job, i) for i in range(len(job.units))]  # all done: read back, in order
    totals = source_totals(job, stats)
    for source, total in zip(job.sources, totals, strict=True):
        if total["documents"] == 0:
            raise DataError(_no_documents(source, total))
    counts = [stat["documents"] for stat in stats]
    names = [shard_name(i, job.num_shards) for i in range(job.num_shards)]
    tasks = [(i, counts, names[i], encoder is not None) for i in range(job.num_shards)]
    shards = pool.map(write_shard, tasks, lambda d, t: report("shards", d, t))
    for name in names:
        os.replace(job.shard(name, "array_record"), directory / name)
    inputs = [
        {
            "path": str(source.path),
            "kind": source.kind,
            "documents": total["documents"],
            "skipped_documents": total["skipped"],
            "problems": total["problems"],
        }
        for source, total in zip(job.sources, totals, strict=True)
    ]
    template = (
        {"origin": encoder.template.origin, "sha256": encoder.template.sha256}
        if encoder is not None
        else None
    )
    manifest = manifest_of(shards, inputs, tokenizer.spec, np.dtype(job.dtype), template)
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=2))
    return manifest


def _no_documents(source: DataSource, total: dict[str, Any]) -> str:
    """What reading ``source`` alone says when none of its documents could be used."""
    if source.kind == "chat":
        first = f"; the first problem: {total['problems'][0]}" if total["problems"] else ""
        return f"chat source {source.name!r} ({source.path}) has no conversations{first}"
    where = f" ({source.path})" if source.path else ""
    if total["skipped"]:
        detail = f"all {total['skipped']} bad documents were skipped; the first: {total['problems'][0]}"
    else:
        detail = "the files hold no text"
    return f"data source {source.name!r}{where} has no documents: {detail}"


def _chat_encoder(sources: Sequence[DataSource], tokenizer: Tokenizer) -> ChatEncoder | None:
    """The encoder of a chat preparation, None for text; refuses a mix of the two."""
    kinds = {s.kind == "chat" for s in sources}
    if len(kinds) > 1:
        chats = [s.path for s in sources if s.kind == "chat"]
        raise DataError(
            f"the inputs mix chat conversations ({', '.join(map(str, chats))}) with text; prepare them into "
            "separate directories and list both as data.sources"
        )
    if kinds != {True}:
        if sources and sources[0].chat_template:
            raise DataError(
                "a chat template was given but the inputs are text; give --format chat for chat data"
            )
        return None
    return ChatEncoder(tokenizer, find_chat_template_for(sources[0], tokenizer))
