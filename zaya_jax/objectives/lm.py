"""``train.objective: lm``: next-token cross-entropy (plus the optional z-loss) on packed text or
chat rows (pretraining, continued pretraining, chat SFT), and the producer of its batches, which
follows the batch ramp and the curriculum stages (:func:`plan_for`). The preference objectives
reuse the producer: their rows come from the same streams."""

from __future__ import annotations

import bisect
import functools
from typing import Any

import jax
import numpy as np

from zaya_jax.config import Config, ConfigError
from zaya_jax.data import DataError
from zaya_jax.data.streams import BatchStreams, make_batch_streams
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.loss import Batch, Objective, loss_and_stats
from zaya_jax.model import Zaya
from zaya_jax.objectives.held_out import HeldOut, saved_run_evaluation
from zaya_jax.objectives.spec import DataPosition, HostBatch, ObjectiveSpec, StepPlan, register
from zaya_jax.programs import TrainState


def plan_for(cfg: Config, tokens_seen: int) -> StepPlan:
    """The batch ramp and curriculum stage in force after ``tokens_seen`` training tokens (with the
    stage's learning-rate multiplier at that token)."""
    train = cfg.train
    batch_size = train.batch_size
    thresholds = [p.tokens for p in train.batch_ramp]
    index = bisect.bisect_right(thresholds, tokens_seen) - 1
    if index >= 0:
        batch_size = train.batch_ramp[index].batch_size
    if not train.stages:
        return StepPlan(batch_size, train.seq_len, 0, None)
    stage, start = train.stage_at(tokens_seen)
    s = train.stages[stage]
    rows = s.batch_size or batch_size
    return StepPlan(rows, s.seq_len, stage, s.mixture, s.lr_multiplier(tokens_seen - start))


class BatchProducer:
    """Produces (plan, host batch, data state) step after step, following the batch ramp and
    curriculum. The plan depends only on tokens already produced, so it is the same whether or not
    batches are prefetched; the data state is the position after the batch (JSON-able). Batches
    come from ``data.streams`` row streams (:mod:`zaya_jax.data.streams`), so the global batch of a
    step is the same on any number of processes and a run resumes on another number.
    ``references``: the preference objectives' reference log-probabilities, per source."""

    on_policy = False  # text does not depend on the model

    def __init__(self, cfg: Config, tokenizer: Tokenizer, references: dict[str, np.ndarray] | None = None):
        self.cfg, self.tokenizer, self.references = cfg, tokenizer, references
        self.prefetch = cfg.data.prefetch
        self.tokens_seen = 0
        self.streams: BatchStreams | None = None
        self.stage = -1

    def _open_stage(self, plan: StepPlan) -> None:
        train = self.cfg.train
        self.streams = make_batch_streams(
            self.cfg.data,
            self.tokenizer,
            seq_len=plan.seq_len,
            seed=train.seed + plan.stage,
            batch_sizes=train.batch_sizes,
            mixture=plan.mixture,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            references=self.references,
        )
        self.stage = plan.stage

    def observe(self, state: TrainState) -> None:
        """Unused: not on-policy."""

    def get_state(self) -> DataPosition:
        """The data position after the last batch produced (this process's streams)."""
        streams = self.streams.get_state() if self.streams is not None else None
        return {"tokens_seen": self.tokens_seen, "stage": self.stage, "streams": streams}

    def set_state(self, saved: list[DataPosition]) -> None:
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

    def __call__(self) -> tuple[StepPlan, HostBatch, DataPosition]:
        plan = plan_for(self.cfg, self.tokens_seen)
        if plan.stage != self.stage:  # a new curriculum stage: new sequence length and mixture
            self._open_stage(plan)
        self.tokens_seen += plan.tokens  # global tokens, all processes together
        batch = self.streams.next_batch(plan.batch_size)  # this process's rows of the global batch
        return plan, batch, self.get_state()


def no_preference_sources(cfg: Config) -> None:
    """Refuses data sources of preference pairs (they only make sense to dpo, ipo and simpo)."""
    pairs = [s.name for s in cfg.data.sources if s.kind == "preference"]
    if pairs:
        raise ConfigError(
            f"data.sources {pairs} hold preference pairs, which train.objective={cfg.train.objective} cannot "
            "use; set train.objective to dpo, ipo or simpo"
        )


def _lm(
    model: Zaya,
    params: dict[str, Any],
    balancing: dict[str, Any],
    batch: Batch,
    *,
    z_loss: float,
    loss_chunk: int,
):
    return loss_and_stats(model, params, balancing, batch, z_loss, loss_chunk)


def next_token(cfg: Config) -> Objective:
    """The next-token loss with ``train.z_loss`` and ``train.loss_chunk`` bound."""
    return Objective("lm", functools.partial(_lm, z_loss=cfg.train.z_loss, loss_chunk=cfg.train.loss_chunk))


LM = register(
    ObjectiveSpec(
        name="lm",
        loss=next_token,
        check=no_preference_sources,
        producer=lambda setup, _: BatchProducer(setup.cfg, setup.tokenizer),
        held_out=lambda setup, _: HeldOut(setup),
        evaluate_saved=saved_run_evaluation(),
    )
)
