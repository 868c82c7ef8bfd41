"""The rollout engine: continuous batching with a slot cache for CCA (:mod:`.scheduler`), its
device programs (:mod:`.programs`) and per-row sampling (:mod:`.sampling`). :func:`zaya_jax.generate.generate`,
GRPO's rollouts and the lm-eval model sample through it."""

from zaya_jax.engine.sampling import filter_logits, filter_rows
from zaya_jax.engine.scheduler import Engine, EngineStats, Finished, Request, check_request

__all__ = ["Engine", "EngineStats", "Finished", "Request", "check_request", "filter_logits", "filter_rows"]
