"""A background thread that produces batches ahead of the training step.

Why not ``grain.experimental.ThreadPrefetchIterDataset``: the producer is not a fixed dataset
graph. Each call follows the batch ramp and curriculum (the batch size and sequence length depend on
the tokens produced so far, and a stage change builds a new row iterator), and returns the data
position that goes with its batch, so the checkpoint saves the position of the last batch consumed,
not of the last one prefetched.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """Calls ``produce()`` on a background thread, keeping up to ``depth`` results ready.

    ``next(prefetcher)`` returns results in order; an exception in ``produce`` is raised there.
    ``depth=0`` calls ``produce`` synchronously. The producer runs ahead of the consumer, so to
    checkpoint the data position, have it return the state with each batch, e.g.
    ``Prefetcher(lambda: (next_batch(rows, size_for(step)), rows.get_state()), depth)``, and save
    the state that came with the last batch consumed; only the producer thread may touch ``rows``.
    """

    def __init__(self, produce: Callable[[], T], depth: int):
        if depth < 0:
            raise ValueError(f"depth={depth} must be >= 0")
        self._produce = produce
        self._stop = threading.Event()
        self._queue: queue.Queue[T | _Failure] = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth:
            self._thread = threading.Thread(target=self._run, name="zaya-data-prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item: T | _Failure = self._produce()
            except BaseException as err:  # handed to the consumer, which decides
                item = _Failure(err)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._thread is None:
            return self._produce()
        if self._stop.is_set():
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the producer thread (idempotent); waits for the ``produce`` call in flight."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
