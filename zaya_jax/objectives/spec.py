"""What an objective is to the rest of the stack: one :class:`ObjectiveSpec` record per
``train.objective`` name, looked up in one registry (:func:`spec_for`), and the typed parts a spec
hands out (:class:`Producer`, the held-out :data:`Evaluator`).

The training loop, ``zaya eval``, planning and the run's programs ask the spec and test no name:
adding an objective is one module that builds a spec and calls :func:`register` (torchtitan's
``ModelSpec`` has the same shape for models). Every part receives what it may use of the run
(:class:`RunSetup` while training, :class:`SavedRun` when a saved model is evaluated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from zaya_jax.config import Config, ConfigError, DataSource, ModelConfig
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.loss import ObjectiveFor
from zaya_jax.programs import Programs, TrainState

HostBatch = dict[str, np.ndarray]
DataPosition = dict[str, Any]  # JSON-able: saved in every checkpoint, one per process


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step trains on: ``batch_size`` rows of ``seq_len`` from curriculum ``stage`` (the
    model of that stage: its RoPE), at ``lr_scale`` times the learning rate (the stage's segment)."""

    batch_size: int
    seq_len: int
    stage: int
    mixture: tuple[float, ...] | None
    lr_scale: float = 1.0

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def fields(self) -> dict[str, Any]:
        """The plan's fields in a metrics record."""
        return {"batch_size": self.batch_size, "seq_len": self.seq_len, "stage": self.stage}


@runtime_checkable
class Producer(Protocol):
    """The batches of a run, one per step: ``producer()`` -> (plan, this process's host batch, the
    data position after it). It states what the loop must know of it:

    - ``prefetch``: batches made ahead of training on a thread (0: each made when it is drawn);
    - ``on_policy``: each batch is made from the weights of the step before it (GRPO samples its
      rollouts from them), so every step is finished before the next is dispatched and
      :meth:`observe` receives the current state before each batch is drawn.

    Optional methods, used where a producer has them: ``ahead_weights() -> list | None``, weights
    it holds beyond its data position (GRPO's rollouts sampled ahead, ``rl.max_staleness``), saved
    with each checkpoint; ``resume_ahead(read)``, called after :meth:`set_state` on a resumed run,
    ``read(count)`` giving those weights back (None when the checkpoint holds none); ``close()``,
    at the run's end (a thread to stop, workers to end).
    """

    prefetch: int
    on_policy: bool

    def observe(self, state: TrainState) -> None: ...

    def get_state(self) -> DataPosition: ...

    def set_state(self, saved: list[DataPosition]) -> None: ...

    def __call__(self) -> tuple[StepPlan, HostBatch, DataPosition]: ...


# (step, state, stage) -> held-out metrics ("loss" first); stage: the curriculum stage whose model
# the state trains (its RoPE: Programs.at_stage), 0 without stages.
Evaluator = Callable[[int, TrainState, int], dict[str, float]]


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What an objective's parts may use of a training run, handed to them once it is set up."""

    cfg: Config
    run_dir: Path
    programs: Programs
    tokenizer: Tokenizer
    state: TrainState  # the state the run continues from (step 1's input on a fresh start)
    fresh_start: bool  # the run starts at step 1 (nothing restored)
    starting_weights: Callable[[], TrainState]  # the run's starting weights (train.init_from or the init)
    event: Callable[..., None]  # event(name, **detail) into events.jsonl
    beat: Callable[[int, str], None]  # the watchdog's beat (step, phase) during long work


class Evaluable(Protocol):
    """What evaluation needs of a saved model (``zaya_jax.LanguageModel`` has it)."""

    config: ModelConfig
    variables: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """A saved model of a run, as ``zaya eval`` evaluates it: its weights, the run's config, the
    run directory (beside ``checkpoints/``), the step and the tokenizer."""

    model: Evaluable
    cfg: Config
    run_dir: Path
    step: int | None
    tokenizer: Tokenizer
    progress: bool = False
    # The run's starting weights (train.init_from's or the initialisation of train.seed) in the
    # given programs' shardings: dpo and ipo score new pairs' reference log-probabilities with them.
    starting_weights: Callable[[Programs], TrainState] | None = None


@dataclasses.dataclass(frozen=True)
class GivenData:
    """The files ``zaya eval RUN --data`` gives, as sources, and the shape arguments (None: the
    run's ``train.seq_len`` and ``train.batch_size``, and every batch)."""

    sources: tuple[DataSource, ...]
    seq_len: int | None = None
    batch_size: int | None = None
    max_batches: int | None = None


def _no_checks(cfg: Config) -> None:
    pass


def _nothing_to_prepare(setup: RunSetup) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """One objective, everything that differs per objective:

    - ``loss``: the settings bound into a loss of :mod:`zaya_jax.loss` (with its batch fields and
      held-out metrics), which the run's programs differentiate;
    - ``check``: config checks beyond each section's own (what data it trains on ...), raising
      :class:`~zaya_jax.config.ConfigError`;
    - ``prepare``: work before step 1 whose result the producer and the evaluator share (dpo's
      reference log-probabilities); None when there is none;
    - ``producer``: the training batches (:class:`Producer`);
    - ``held_out``: the evaluation every ``eval.every`` steps (:data:`Evaluator`);
    - ``evaluate_saved``: what ``zaya eval`` of a saved run reports (a dict with ``loss`` and
      ``evaluated``, the latter saying what was evaluated, in words);
    - ``evaluate_data``: what ``zaya eval RUN --data FILES`` reports when the objective scores
      files of its own kind (the preference objectives: pairs, by their loss), the same dict;
      None: the files' next-token loss, read as text.
    """

    name: str
    loss: ObjectiveFor
    producer: Callable[[RunSetup, Any], Producer]
    held_out: Callable[[RunSetup, Any], Evaluator]
    evaluate_saved: Callable[[SavedRun], dict[str, Any]]
    check: Callable[[Config], None] = _no_checks
    prepare: Callable[[RunSetup], Any] = _nothing_to_prepare
    evaluate_data: Callable[[SavedRun, GivenData], dict[str, Any]] | None = None


_REGISTRY: dict[str, ObjectiveSpec] = {}


def register(spec: ObjectiveSpec, *, replace: bool = False) -> ObjectiveSpec:
    """Make ``spec`` the one ``train.objective: <spec.name>`` runs (``replace`` to redefine one)."""
    if spec.name in _REGISTRY and not replace and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"an objective named {spec.name!r} is registered already; pass replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registered objective (a test's own, when it is done)."""
    _REGISTRY.pop(name, None)


def registered() -> tuple[str, ...]:
    """The names ``train.objective`` accepts, in registration order."""
    return tuple(_REGISTRY)


def spec_for(cfg: Config | str) -> ObjectiveSpec:
    """The spec of ``cfg.train.objective`` (or of a name)."""
    name = cfg if isinstance(cfg, str) else cfg.train.objective
    if name not in _REGISTRY:
        raise ConfigError(
            f"train.objective={name!r} is not an objective; use one of {', '.join(_REGISTRY)} (or register "
            "one with zaya_jax.objectives.register)"
        )
    return _REGISTRY[name]


def check(cfg: Config) -> ObjectiveSpec:
    """``cfg``'s objective checked against the rest of ``cfg``; returns its spec."""
    spec = spec_for(cfg)
    spec.check(cfg)
    return spec
