"""What a run trains for: one :class:`ObjectiveSpec` per ``train.objective`` name (``lm``, ``dpo``,
``ipo``, ``simpo``, ``grpo``), each holding the loss (from :mod:`zaya_jax.loss`), its batch fields,
its config checks, its batch producer, its held-out evaluator and what ``zaya eval`` reports for a
saved run. The training loop, planning and ``zaya eval`` ask :func:`spec_for` and test no name.

Adding an objective is one module: build an :class:`ObjectiveSpec` and :func:`register` it
(docs/ARCHITECTURE.md, "Adding an objective"); ``tests/objectives/test_spec.py`` trains one that
lives in the test alone.
"""

from collections.abc import Sequence
from typing import Any

from zaya_jax.config import Config
from zaya_jax.objectives import grpo, lm, preference  # noqa: F401  (the built-in specs register)
from zaya_jax.objectives.spec import (
    DataPosition,
    Evaluable,
    Evaluator,
    GivenData,
    HostBatch,
    ObjectiveSpec,
    Producer,
    RunSetup,
    SavedRun,
    StepPlan,
    check,
    register,
    registered,
    spec_for,
    unregister,
)
from zaya_jax.optim import LeafGroup
from zaya_jax.parallel import Layout
from zaya_jax.programs import Programs
from zaya_jax.programs import build_programs as _build


def build_programs(
    cfg: Config,
    layout: Layout | None = None,
    *,
    devices: Sequence[Any] | None = None,
    groups: dict[str, LeafGroup] | None = None,
) -> Programs:
    """The programs of ``cfg`` training its ``train.objective`` (:func:`zaya_jax.programs.build_programs`
    with the spec's loss): what ``zaya train``, ``--compile-only``, the benchmarks and the notebooks run."""
    return _build(cfg, layout, objective=spec_for(cfg).loss, devices=devices, groups=groups)


__all__ = [
    "DataPosition",
    "Evaluable",
    "Evaluator",
    "GivenData",
    "HostBatch",
    "ObjectiveSpec",
    "Producer",
    "RunSetup",
    "SavedRun",
    "StepPlan",
    "build_programs",
    "check",
    "register",
    "registered",
    "spec_for",
    "unregister",
]
