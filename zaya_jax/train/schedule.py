"""What each step trains on: the batch ramp, the curriculum stages, and the producer that turns
them into host batches (on the prefetch thread, ahead of training)."""

from __future__ import annotations

import bisect
import dataclasses
import warnings
from typing import Any

import jax
import numpy as np

from zaya_jax.config import Config, ConfigError
from zaya_jax.data import DataError, load_tokenizer
from zaya_jax.data.streams import make_batch_streams


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step trains on: ``batch_size`` rows of ``seq_len`` from curriculum ``stage``."""

    batch_size: int
    seq_len: int
    stage: int
    mixture: tuple[float, ...] | None

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def fields(self) -> dict[str, int]:
        """The plan's fields in a metrics record."""
        return {"batch_size": self.batch_size, "seq_len": self.seq_len, "stage": self.stage}


def plan_for(cfg: Config, tokens_seen: int) -> StepPlan:
    """The batch ramp and curriculum stage in force after ``tokens_seen`` training tokens."""
    train = cfg.train
    batch_size = train.batch_size
    thresholds = [p.tokens for p in train.batch_ramp]
    index = bisect.bisect_right(thresholds, tokens_seen) - 1
    if index >= 0:
        batch_size = train.batch_ramp[index].batch_size
    if not train.stages:
        return StepPlan(batch_size, train.seq_len, 0, None)
    boundaries = np.cumsum([s.tokens for s in train.stages])
    stage = min(int(np.searchsorted(boundaries, tokens_seen, side="right")), len(train.stages) - 1)
    return StepPlan(batch_size, train.stages[stage].seq_len, stage, train.stages[stage].mixture)


def check_run(cfg: Config) -> Any:
    """The checks before a run, returning its tokenizer: an error when the tokenizer's ids do not
    fit the model's vocabulary, a warning for each of :func:`plan_warnings`."""
    for warning in plan_warnings(cfg):
        warnings.warn(warning, stacklevel=3)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size}"
        )
    return tokenizer


def plan_warnings(cfg: Config) -> list[str]:
    """Settings that are valid but almost certainly not meant (the run still starts)."""
    out = []
    if cfg.optim.warmup_steps >= cfg.train.steps:
        out.append(
            f"optim.warmup_steps={cfg.optim.warmup_steps} >= train.steps={cfg.train.steps}: the learning rate "
            "never reaches its peak; lower optim.warmup_steps"
        )
    return out


def final_batch_size(cfg: Config) -> int:
    """The batch size at the end of the ramp (the one the learning rates are set for)."""
    return cfg.train.batch_ramp[-1].batch_size if cfg.train.batch_ramp else cfg.train.batch_size


class BatchProducer:
    """Produces (plan, host batch, data state) step after step, following the batch ramp and
    curriculum. The plan depends only on tokens already produced, so it is the same whether or not
    batches are prefetched; the data state is the position after the batch (JSON-able). Batches
    come from ``data.streams`` row streams (:mod:`zaya_jax.data.streams`), so the global batch of a
    step is the same on any number of processes and a run resumes on another number."""

    def __init__(self, cfg: Config, tokenizer: Any, references: dict[str, np.ndarray] | None = None):
        self.cfg, self.tokenizer, self.references = cfg, tokenizer, references
        self.tokens_seen = 0
        self.streams, self.stage = None, -1

    def _open_stage(self, plan: StepPlan) -> None:
        train = self.cfg.train
        self.streams = make_batch_streams(
            self.cfg.data,
            self.tokenizer,
            seq_len=plan.seq_len,
            seed=train.seed + plan.stage,
            batch_sizes=[train.batch_size, *(p.batch_size for p in train.batch_ramp)],
            mixture=plan.mixture,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            references=self.references,
        )
        self.stage = plan.stage

    def observe(self, state: Any) -> None:
        """The state the next batch is for: unused, text does not depend on the model (GRPO's
        producer, :class:`zaya_jax.train.rollouts.Rollouts`, samples from it)."""

    def get_state(self) -> dict[str, Any]:
        """The data position after the last batch produced (this process's streams)."""
        streams = self.streams.get_state() if self.streams is not None else None
        return {"tokens_seen": self.tokens_seen, "stage": self.stage, "streams": streams}

    def set_state(self, saved: list[dict[str, Any]]) -> None:
        """Continue from the data states every process of a run saved (any number of processes)."""
        if any("streams" not in state for state in saved):
            raise DataError(
                "the checkpoint's data position was saved by an older zaya-jax (documents split by "
                "process, not by data stream); continue it with that version or start a new run from "
                "its weights (train.init_from)"
            )
        positions = {(int(s["tokens_seen"]), int(s["stage"])) for s in saved}
        if len(positions) != 1:
            raise DataError(f"the saved data positions disagree on (tokens_seen, stage): {sorted(positions)}")
        ((self.tokens_seen, stage),) = positions
        self.streams, self.stage = None, -1
        if saved[0]["streams"] is not None:
            stages = self.cfg.train.stages
            seq_len = stages[stage].seq_len if stages else self.cfg.train.seq_len
            mixture = stages[stage].mixture if stages else None
            self._open_stage(StepPlan(0, seq_len, stage, mixture))
            self.streams.set_state([state["streams"] for state in saved])

    def __call__(self) -> tuple[StepPlan, dict[str, np.ndarray], dict[str, Any]]:
        plan = plan_for(self.cfg, self.tokens_seen)
        if plan.stage != self.stage:  # a new curriculum stage: new sequence length and mixture
            self._open_stage(plan)
        self.tokens_seen += plan.tokens  # global tokens, all processes together
        batch = self.streams.next_batch(plan.batch_size)  # this process's rows of the global batch
        return plan, batch, self.get_state()
