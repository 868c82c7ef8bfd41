"""Low-rank adapters (LoRA) on every routed expert and CCA's projections (:mod:`.adapters`)."""

from zaya_jax.lora.adapters import (
    DEFAULT_TARGETS,
    REFUSED,
    ROLES,
    Lora,
    delta,
    inert,
    init_adapters,
    merge,
    targeted,
)

__all__ = [
    "DEFAULT_TARGETS",
    "REFUSED",
    "ROLES",
    "Lora",
    "delta",
    "inert",
    "init_adapters",
    "merge",
    "targeted",
]
