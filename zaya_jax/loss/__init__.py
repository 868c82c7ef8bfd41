"""The training objectives and the forward pass they share.

``forward`` (per-token negative log-likelihood through the chunked LM head, routing statistics,
per-segment sums) -> ``next_token`` (pretraining and SFT), ``preference`` (DPO, IPO, SimPO),
``policy`` (GRPO) -> ``contract`` (the :class:`Objective` record a spec binds one of them into,
and the held-out evaluation step). Which objective a run trains is :mod:`zaya_jax.objectives`'."""

from zaya_jax.loss.contract import FieldSpec, MetricBound, Objective, ObjectiveFor, average, make_eval_step
from zaya_jax.loss.forward import Batch, segment_sums, token_losses, token_nll, under_axis_rules
from zaya_jax.loss.next_token import loss_and_stats
from zaya_jax.loss.preference import sequence_logps

__all__ = [
    "Batch",
    "FieldSpec",
    "MetricBound",
    "Objective",
    "ObjectiveFor",
    "average",
    "loss_and_stats",
    "make_eval_step",
    "segment_sums",
    "sequence_logps",
    "token_losses",
    "token_nll",
    "under_axis_rules",
]
