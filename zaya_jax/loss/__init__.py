"""The training objectives and the forward pass they share.

``forward`` (per-token negative log-likelihood through the chunked LM head, routing statistics,
per-segment sums) -> ``next_token`` (pretraining and SFT), ``preference`` (DPO, IPO, SimPO),
``policy`` (GRPO) -> ``objectives`` (``train.objective`` -> the function the step differentiates,
and the held-out evaluation step)."""

from zaya_jax.loss.forward import Batch, segment_sums, token_losses, token_nll, under_axis_rules
from zaya_jax.loss.next_token import loss_and_stats
from zaya_jax.loss.objectives import Objective, average, make_eval_step, objective_for
from zaya_jax.loss.preference import sequence_logps

__all__ = [
    "Batch",
    "Objective",
    "average",
    "loss_and_stats",
    "make_eval_step",
    "objective_for",
    "segment_sums",
    "sequence_logps",
    "token_losses",
    "token_nll",
    "under_axis_rules",
]
