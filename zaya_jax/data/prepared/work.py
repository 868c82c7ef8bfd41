"""How ``zaya data prepare`` spreads its work over hosts and worker processes, and resumes it.

The inputs are cut into *units*: one file, or a line-aligned byte range of about ``CHUNK_BYTES``
of a large uncompressed JSONL file (the built-in corpus is one unit). Host ``h`` of ``H``
tokenizes units ``h, h + H, ...`` over its worker processes, each unit into a *piece* (an
ArrayRecord of its documents' tokens, in input order). Host 0 then waits for every piece, deals
the documents round-robin into the shards (over its workers, one shard each), and publishes the
directory with its manifest (:mod:`zaya_jax.data.prepared.writer`). Document ``i`` of the whole input
lands in the same record of the same shard whatever the number of hosts and workers, so the
output is byte-identical to one process's.

Everything is kept in ``<parent>/.<name>.work-<plan>/`` (``plan``: a hash of the inputs' paths,
sizes and modification times, the tokenizer, the template, the shard count and the options):
``plan.json``, ``pieces/unit-UUUUUU.{array_record,json}`` and ``shards/<shard>.{array_record,json}``.
A piece or shard counts as done once its ``.json`` exists (written last, atomically), so a killed
preparation rerun with the same command redoes only its unfinished units and shards; a different
command gets another work directory (host 0 removes the others of the same output). The work
directory is removed once the output is published, or when one host preparing alone fails.

Why our own and not Megatron's ``preprocess_data.py --workers`` or a Grain/Beam pipeline: the
output format, its round-robin layout and the manifest are this project's, and neither of those
splits one preparation over hosts with per-unit resume while keeping a one-process byte layout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from zaya_jax.config import DataSource
from zaya_jax.config.data import BUILT_IN
from zaya_jax.data.chat import ChatEncoder, encode_records
from zaya_jax.data.prepared.format import READER_OPTIONS, WRITER_OPTIONS
from zaya_jax.data.sources import (
    COMPRESSED,
    PROBLEMS_KEPT,
    BadDocuments,
    DataError,
    built_in_documents,
    iter_record_range,
    parquet_documents,
    record_texts,
    resolve_files,
    text_documents,
)
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.files import read_json, sha256_file, write_atomic

CHUNK_BYTES = 32 << 20  # a unit of a large JSONL file
_ENCODE_BATCH = 256
READER_THREAD = "zaya-prepare-reader"


@dataclasses.dataclass(frozen=True)
class Unit:
    """Input ``source``'s file ``path`` (lines starting in bytes ``[start, end)``, the first being
    line ``first_line``; ``end`` None: to the end); ``path`` empty: the built-in corpus."""

    source: int
    key: str = ""
    path: str = ""
    start: int = 0
    end: int | None = None
    first_line: int = 1


def plan_units(sources: Sequence[DataSource], chunk_bytes: int = CHUNK_BYTES) -> list[Unit]:
    """The units of ``sources``, in input order (large uncompressed JSONL files cut into ranges of
    about ``chunk_bytes``)."""
    if chunk_bytes < 1:
        raise DataError(f"a unit of {chunk_bytes} bytes is too small; give at least 1")
    units = []
    for i, source in enumerate(sources):
        if source.kind in BUILT_IN:
            units.append(Unit(i))
            continue
        for key, path in resolve_files(source):
            splittable = source.kind in ("jsonl", "chat") and not path.name.endswith(COMPRESSED)
            if splittable and path.stat().st_size > chunk_bytes:
                units += [Unit(i, key, str(path), *lines) for lines in _line_ranges(path, chunk_bytes)]
            else:
                units.append(Unit(i, key, str(path)))
    return units


def _line_ranges(path: Path, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(start, end, first line) of consecutive ranges of about ``chunk_bytes``, cut after a newline."""
    size, ranges, start, line = path.stat().st_size, [], 0, 1
    with path.open("rb") as f:
        while start < size:
            f.seek(min(start + chunk_bytes, size))
            f.readline()  # on to the next line start
            end = min(f.tell(), size)
            ranges.append((start, end, line))
            f.seek(start)
            remaining = end - start
            while remaining:
                block = f.read(min(remaining, 8 << 20))
                line += block.count(b"\n")
                remaining -= len(block)
            start = end
    return ranges


def unit_arrays(
    unit: Unit, source: DataSource, tokenizer: Tokenizer, encoder: ChatEncoder | None, bad: BadDocuments
) -> Iterator[np.ndarray]:
    """The unit's documents as token arrays (a chat's as (2, n) ids and trained flags)."""
    files = [(unit.key, Path(unit.path))]
    if source.kind in BUILT_IN:
        texts = (text for _, text in built_in_documents(source, bad))
    elif source.kind == "text":
        texts = (text for _, text in text_documents(files, bad))
    elif source.kind == "parquet":
        texts = (text for _, text in parquet_documents(files, source.text_field, bad))
    else:
        records = iter_record_range(unit.key, Path(unit.path), bad, unit.start, unit.end, unit.first_line)
        if encoder is not None:
            yield from (document for _, document in encode_records(records, encoder.encode_record, bad))
            return
        texts = (text for _, text in record_texts(records, source.text_field, bad))
    for batch in _prefetched(_batches(texts, _ENCODE_BATCH)):  # read the next batch while this one encodes
        yield from tokenizer.encode_batch(batch)


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _prefetched(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """``items`` produced by a background thread, ``depth`` ahead (reading and JSON parsing hold
    the GIL, the HF tokenizer's ``encode_batch`` releases it: the two overlap); the producer's
    exception is raised here, in order. A consumer that stops early (an error while writing) stops
    the producer too."""
    slots: queue.Queue = queue.Queue(depth)
    end, closed = object(), threading.Event()

    def put(entry: tuple[Any, BaseException | None]) -> bool:
        while not closed.is_set():
            try:
                slots.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
        except BaseException as err:  # handed to the consumer
            put((end, err))
            return
        put((end, None))

    threading.Thread(target=produce, name=READER_THREAD, daemon=True).start()
    try:
        while True:
            item, err = slots.get()
            if item is end:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        closed.set()


@dataclasses.dataclass
class Job:
    """One preparation: what every host and worker needs to do its part (picklable)."""

    sources: list[DataSource]
    units: list[Unit]
    num_shards: int
    dtype: str
    on_bad_document: str
    work: Path

    def piece(self, index: int, suffix: str) -> Path:
        return self.work / "pieces" / f"unit-{index:06d}.{suffix}"

    def shard(self, name: str, suffix: str) -> Path:
        return self.work / "shards" / f"{name}.{suffix}"

    def done_units(self) -> set[int]:
        return {i for i in range(len(self.units)) if self.piece(i, "json").is_file()}


def open_work(destination: Path, plan: dict[str, Any], primary: bool) -> Path:
    """The work directory of ``plan`` beside ``destination`` (see the module doc); the primary
    host removes the work directories of other plans for the same destination."""
    digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    work = destination.parent / f".{destination.name}.work-{digest}"
    if primary:
        for stale in destination.parent.glob(f".{destination.name}.work-*"):
            if stale != work and stale.is_dir():
                shutil.rmtree(stale)
    for sub in ("pieces", "shards"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    write_atomic(work / "plan.json", json.dumps(plan, indent=1, sort_keys=True))
    return work


def plan_of(sources: Sequence[DataSource], units: Sequence[Unit], settings: dict[str, Any]) -> dict[str, Any]:
    """What decides the output: the settings and every unit with its file's size and mtime."""
    files = []
    for unit in units:
        stat = os.stat(unit.path) if unit.path else None
        files.append(
            [dataclasses.astuple(unit), stat.st_size if stat else 0, stat.st_mtime_ns if stat else 0]
        )
    return {"settings": settings, "sources": [dataclasses.asdict(s) for s in sources], "units": files}


# --- the worker side (each worker process builds its tokenizer once) ----------------------------
_WORKER: dict[str, Any] = {}


def init_worker(
    job: Job, make_tools: Callable[[], tuple[Tokenizer, ChatEncoder | None]], threads: int
) -> None:
    if threads:
        os.environ["RAYON_RS_NUM_CPUS"] = str(threads)  # the HF tokenizer's threads, before its first use
    _WORKER["job"] = job
    _WORKER["tools"] = make_tools()


def write_piece(index: int) -> dict[str, Any]:
    """Tokenize unit ``index`` into its piece (unless done); returns its stats."""
    job: Job = _WORKER["job"]
    done = job.piece(index, "json")
    if done.is_file():
        return piece_stats(job, index)
    tokenizer, encoder = _WORKER["tools"]
    unit = job.units[index]
    bad = BadDocuments(job.on_bad_document)  # type: ignore[arg-type]
    dtype = np.dtype(job.dtype).newbyteorder("<")
    writer = ArrayRecordWriter(str(job.piece(index, "array_record")), WRITER_OPTIONS)
    documents = tokens = 0
    try:
        for ids in unit_arrays(unit, job.sources[unit.source], tokenizer, encoder, bad):
            if ids.size:
                writer.write(ids.astype(dtype).tobytes())
                documents += 1
                tokens += int(ids.shape[-1])
    finally:
        writer.close()
    stats = {"documents": documents, "tokens": tokens, "skipped": bad.count, "problems": bad.problems}
    write_atomic(done, json.dumps(stats))
    return stats


def piece_stats(job: Job, index: int) -> dict[str, Any]:
    """The stats a finished unit's piece recorded (documents, tokens, skipped, problems)."""
    return read_json(job.piece(index, "json"), "a finished piece of zaya data prepare")


def write_shard(shard: int, counts: Sequence[int], name: str, chat: bool) -> dict[str, Any]:
    """Deal document ``i`` of the whole input (``counts``: documents per unit) into shard
    ``i % num_shards`` as record ``i // num_shards``: this shard's records, from the pieces."""
    job: Job = _WORKER["job"]
    done = job.shard(name, "json")
    if done.is_file():
        return read_json(done, "a finished shard of zaya data prepare")
    path = job.shard(name, "array_record")
    per_token = np.dtype(job.dtype).itemsize * (2 if chat else 1)
    writer = ArrayRecordWriter(str(path), WRITER_OPTIONS)
    records = tokens = offset = 0
    try:
        for index, count in enumerate(counts):
            wanted = list(range((shard - offset) % job.num_shards, count, job.num_shards))
            offset += count
            if not wanted:
                continue
            reader = ArrayRecordReader(str(job.piece(index, "array_record")), READER_OPTIONS)
            try:
                for record in reader.read(wanted):
                    writer.write(record)
                    records += 1
                    tokens += len(record) // per_token
            finally:
                reader.close()
    finally:
        writer.close()
    entry = {"file": name, "records": records, "tokens": tokens, "bytes": path.stat().st_size}
    entry["sha256"] = sha256_file(path)
    write_atomic(done, json.dumps(entry))
    return entry


# --- running it ----------------------------------------------------------------------------------
class Workers:
    """``workers`` processes (1: this one) that each hold the tokenizer, for every phase of a
    preparation: ``with Workers(job, make_tools, n) as pool: pool.map(write_piece, tasks, progress)``."""

    def __init__(
        self, job: Job, make_tools: Callable[[], tuple[Tokenizer, ChatEncoder | None]], workers: int
    ):
        self.job, self.make_tools, self.workers = job, make_tools, workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __enter__(self) -> Workers:
        if self.workers <= 1:
            init_worker(self.job, self.make_tools, 0)
        else:
            threads = max(1, (os.cpu_count() or 1) // self.workers)  # the HF tokenizer's, per worker
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),  # never fork a process holding threads
                initializer=init_worker,
                initargs=(self.job, self.make_tools, threads),
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def map(
        self,
        function: Callable[..., dict[str, Any]],
        tasks: Sequence[Any],
        progress: Callable[[int, int], None],
    ) -> list[dict[str, Any]]:
        """``function(*task)`` for every task, results in task order; ``progress(done, total)``."""
        if self._pool is None:
            out = []
            for task in tasks:
                out.append(function(*task))
                progress(len(out), len(tasks))
            return out
        results: list[Any] = [None] * len(tasks)
        futures = {self._pool.submit(function, *task): i for i, task in enumerate(tasks)}
        for finished, future in enumerate(concurrent.futures.as_completed(futures), 1):
            results[futures[future]] = future.result()
            progress(finished, len(tasks))
        return results


def wait_for_pieces(job: Job, timeout_s: float, progress: Callable[[int, int], None]) -> None:
    """Block until every unit's piece is done (other hosts write theirs); a condition, polled."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while len(done := job.done_units()) < len(job.units):
        if len(done) != last:
            progress(len(done), len(job.units))
            last = len(done)
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(job.units))) - done)
            raise DataError(
                f"zaya data prepare: after {timeout_s:.0f} s, {len(missing)} of {len(job.units)} units are not "
                f"done (the first: {missing[:5]}; unit u is host u % num_hosts's); start the missing hosts "
                "with the same command, or rerun with fewer --num-hosts"
            )
        time.sleep(0.5)
    progress(len(job.units), len(job.units))


def source_totals(job: Job, stats: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per input source: documents, skipped documents and the first problems, from its units."""
    totals = [{"documents": 0, "skipped": 0, "problems": []} for _ in job.sources]
    for unit, stat in zip(job.units, stats, strict=True):
        total = totals[unit.source]
        total["documents"] += stat["documents"]
        total["skipped"] += stat["skipped"]
        total["problems"] = (total["problems"] + stat["problems"])[:PROBLEMS_KEPT]
    return totals
