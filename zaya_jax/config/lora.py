"""The ``lora`` section: low-rank adapters trained on a frozen base (``rank`` 0: full fine-tuning)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from zaya_jax.config.errors import ConfigError

# Roles a target may name -> what each adapts (zaya_jax.model.lowrank maps them to parameters).
LORA_ROLES: dict[str, str] = {
    "experts": "every routed expert's fused gate/up wi and its wo, one adapter per expert and layer",
    "attention": "CCA's q, k, current-value, delayed-value and output projections",
    "embeddings": "the embedding table (and with it the tied LM head)",
}
# Roles that are not adapted, and why (an "all-linear" adapter that wraps the router changes routing).
LORA_REFUSED: dict[str, str] = {
    "router": "the router picks each token's expert by an argmax of its output, so an adapter there "
    "changes routing rather than the experts; adapt the experts",
    "eda": "the router's exponential depth averaging state is part of the router (see 'router')",
    "balancing": "the balancing biases are set by the balancing controller, not by gradients",
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (:mod:`zaya_jax.lora`): each targeted weight ``W`` becomes ``W + s A B``
    with ``A`` (in, rank) and ``B`` (rank, out) per expert and layer, ``s = alpha / rank`` (or
    ``alpha / sqrt(rank)`` with ``rslora``). Only ``A`` and ``B`` train, with AdamW at
    ``optim.adam_lr`` and its schedule (about 10x a full fine-tuning rate: 1e-4 to 1e-3 for SFT and
    DPO, as "LoRA Without Regret" measured); the base carries no gradient and no optimizer state and
    is never written back. The base is ``train.init_from`` (required); checkpoints hold the
    adapters, and the base's fingerprint, checked on every resume and load."""

    rank: int = 0  # adapter rank r (0: no adapters, every parameter trains)
    alpha: float = 32.0  # scale numerator: s = alpha / rank (rslora: alpha / sqrt(rank))
    rslora: bool = False  # rank-stabilised scaling alpha / sqrt(rank)
    # Roles adapted: "experts", "attention", "embeddings"; the router, its EDA state and the
    # balancing biases are refused (see LORA_REFUSED).
    targets: tuple[str, ...] = ("experts", "attention")
    # Storage of the frozen base's matrices ("bfloat16" halves its memory; the adapted weights are
    # summed in float32 either way); vectors (norms, scales, biases) stay float32.
    base_dtype: Literal["float32", "bfloat16"] = "float32"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def validate(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"lora.rank={self.rank!r} must be an integer >= 0 (0: no adapters)")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"lora.alpha={self.alpha!r} must be a finite number > 0")
        if not self.targets:
            raise ConfigError(f"lora.targets is empty; name at least one of {', '.join(LORA_ROLES)}")
        for role in self.targets:
            if role in LORA_REFUSED:
                raise ConfigError(f"lora.targets: {role!r} is refused: {LORA_REFUSED[role]}")
            if role not in LORA_ROLES:
                raise ConfigError(
                    f"lora.targets: unknown role {role!r}; the roles are {', '.join(LORA_ROLES)}"
                )
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"lora.targets={list(self.targets)} names a role twice")
