"""Rollouts sampled ahead of training (``rl.max_staleness = k > 0``): while rollout j trains, one
background thread samples the rollouts after it, rollout j + k from the weights rollout j starts
training with (its parameter *version*: the optimizer steps they have taken).

The schedule is a function of the rollout's number alone, never of timing: rollout j is sampled
from the weights of rollout j - k's first step (the starting weights for j < k), so a run gives the
same rollouts however fast its sampler and trainer are, and a synchronous run fed those stale
weights gives the same rollouts too (``tests/objectives/test_ahead.py``). Each sampled rollout is
handed its weights as a copy (the train step donates its state's buffers) and, on several
processes, made usable by this process alone on the main thread (:func:`~zaya_jax.parallel.process_local`
may gather, a collective that must keep the same order in every process); the worker thread then
runs only this process's programs. Its rows are gathered across processes on the main thread too,
when the rollout is taken (:meth:`Ahead.next`).

The k weights in flight are saved with each checkpoint (``ahead`` item, see
:func:`zaya_jax.checkpoint.restore_ahead`) and their versions with the data position: a resumed
run samples the rollouts in flight at the save again from those weights, so it continues as the
uninterrupted run does, bit for bit. The prompt position of a rollout depends on the ones before it
(``rl.dynamic_sampling`` draws more prompts for tied groups), so the worker chains it: rollouts are
sampled one at a time, in order.

Why a thread and not a second process or device group: it keeps one copy of the programs and the
compiled cache, needs no weight transfer beyond an on-device copy, and on a machine whose sampler
is dispatch-bound (small models, Python scheduling between decode steps) the trainer's programs fill
the gaps. Disaggregated sampling on devices of its own (PipelineRL, AReaL) is the next step for
large models."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp

from zaya_jax.parallel import process_local

Variables = dict[str, Any]  # {"params": ..., "balancing": ...}
# (rollout number, prompt position, this process's weights, their version) -> the sampled rollout
Sample = Callable[[int, int, Variables, int], Any]


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A rollout being sampled (or sampled and not yet taken)."""

    index: int  # the rollout's number
    version: int  # the optimizer steps of the weights it is sampled from
    weights: Variables  # those weights, in the train state's layout (saved with a checkpoint)
    future: Future


class Ahead:
    """Rollouts ``depth`` ahead of the one training, sampled in order on one background thread by
    ``sample(index, prompt position, weights, version)``, whose result has the prompt position after
    it as ``consumed``; none after rollout ``last`` (the run's final one)."""

    def __init__(self, depth: int, sample: Sample, last: int):
        self.depth, self.sample, self.last = depth, sample, last
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="zaya-rollouts")
        self.queue: deque[InFlight] = deque()
        self.cursor = 0  # the prompt position of the next rollout the worker samples (its own)
        self.restored: list[tuple[int, Variables]] = []  # (version, weights) saved with a checkpoint

    def next(self, index: int, consumed: int, variables: Variables, version: int) -> Any:
        """Rollout ``index`` (its prompts start at ``consumed``), once sampled; before waiting for
        it, rollout ``index + depth`` starts from ``variables`` (version ``version``). The first
        call of a run starts the ``depth`` rollouts before that one too: from the weights saved with
        the checkpoint resumed (as many as it holds), the others from ``variables``."""
        if not self.queue:
            self.cursor = consumed  # nothing is running: the worker's cursor is free to set
            earlier = self.restored + [(version, variables)] * (self.depth - len(self.restored))
            self.restored = []
            for offset, (at, weights) in enumerate(earlier):
                self._launch(index + offset, at, weights)
        self._launch(index + self.depth, version, variables)
        head = self.queue.popleft()
        if head.index != index:
            raise RuntimeError(f"rollout {head.index} is next in flight, not {index}")
        return head.future.result()  # the worker's exception (a reward error, ...) is raised here

    def _launch(self, index: int, version: int, variables: Variables) -> None:
        if index > self.last:  # past the run's end: nothing would train it
            return
        weights = jax.tree.map(jnp.copy, variables)  # dispatched before the next step donates them
        local = process_local(weights)  # may gather: a collective, here on the main thread
        future = self.executor.submit(self._run, index, version, local)
        self.queue.append(InFlight(index, version, weights, future))

    def _run(self, index: int, version: int, local: Variables) -> Any:
        sampled = self.sample(index, self.cursor, local, version)
        self.cursor = sampled.consumed
        return sampled

    def versions(self) -> list[int]:
        """The parameter versions of the rollouts in flight, next first (the data position's
        ``ahead``)."""
        return [flight.version for flight in self.queue]

    def weights(self) -> list[Variables]:
        """The weights of the rollouts in flight, next first (saved with a checkpoint)."""
        return [flight.weights for flight in self.queue]

    def restore(self, versions: list[int], weights: list[Variables]) -> None:
        """Sample the rollouts that were in flight at a checkpoint again from their saved weights."""
        self.queue.clear()
        self.restored = list(zip(versions, weights, strict=True))

    def close(self) -> None:
        """Drop the rollouts not yet started and wait for the one being sampled (a rollout cannot
        be cut mid-way: the exit waits at most one rollout's sampling)."""
        for flight in self.queue:
            flight.future.cancel()
        self.queue.clear()
        self.executor.shutdown(wait=True, cancel_futures=True)
