"""Learning-rate schedules (warmup-stable-decay, cosine, constant) and the batch-size lr rule."""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import optax

ScheduleKind = Literal["wsd", "cosine", "constant"]
BatchScaling = Literal["none", "sqrt", "linear"]


def learning_rate_schedule(
    kind: ScheduleKind,
    peak: float,
    total_steps: int,
    warmup_steps: int,
    decay_fraction: float,
    min_lr_ratio: float,
) -> optax.Schedule:
    """``step -> lr`` (float32), traceable.

    All kinds warm up linearly from 0 at step 0 to ``peak`` at ``warmup_steps``. Then:

    * ``wsd``: constant ``peak``, then linear decay over the last ``decay_fraction * total_steps``
      steps to ``min_lr_ratio * peak`` at ``total_steps`` (held after). If warmup and decay overlap
      (a short run), the lower of the two ramps applies, so the lr never exceeds either.
    * ``cosine``: cosine from ``peak`` at ``warmup_steps`` to ``min_lr_ratio * peak`` at ``total_steps``.
    * ``constant``: ``peak`` (``decay_fraction`` and ``min_lr_ratio`` unused).
    """
    if kind not in ("wsd", "cosine", "constant"):
        raise ValueError(f"schedule kind {kind!r} is unknown; choose 'wsd', 'cosine' or 'constant'")
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction={decay_fraction} must be in [0, 1]")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    decay_steps = decay_fraction * total_steps
    decay_start = total_steps - decay_steps
    cosine_steps = max(total_steps - warmup_steps, 1)

    def warmup(step: jax.Array) -> jax.Array:
        return jnp.minimum(step / warmup_steps, 1.0) if warmup_steps > 0 else jnp.ones_like(step)

    def schedule(count: jax.Array | int) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        if kind == "constant":
            factor = warmup(step)
        elif kind == "wsd":
            decayed = 1.0
            if decay_steps > 0:
                progress = jnp.clip((step - decay_start) / decay_steps, 0.0, 1.0)
                decayed = 1.0 - (1.0 - min_lr_ratio) * progress
            factor = jnp.minimum(warmup(step), decayed)
        else:
            progress = jnp.clip((step - warmup_steps) / cosine_steps, 0.0, 1.0)
            cosine = min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
            factor = jnp.where(step < warmup_steps, warmup(step), cosine)
        return (peak * factor).astype(jnp.float32)

    return schedule


def batch_lr_scale(batch_size: int, reference_batch: int, mode: BatchScaling) -> float:
    """Learning-rate multiplier for a batch of ``batch_size`` when the lr was tuned at ``reference_batch``.

    ``none``: 1; ``sqrt``: (batch / reference)^(1/2) (Adam-style noise scaling); ``linear``:
    batch / reference (SGD's linear rule). Used under a batch-size ramp with ``set_lr_scale``.
    """
    if batch_size < 1 or reference_batch < 1:
        raise ValueError(f"batch sizes must be positive, got {batch_size} and reference {reference_batch}")
    ratio = batch_size / reference_batch
    if mode == "none":
        return 1.0
    if mode == "sqrt":
        return math.sqrt(ratio)
    if mode == "linear":
        return ratio
    raise ValueError(f"lr batch scaling {mode!r} is unknown; choose 'none', 'sqrt' or 'linear'")
