"""Low-rank adapters (LoRA) on every routed expert and CCA's projections (:mod:`.adapters`)."""

from zaya_jax.lora.adapters import (
    Adapters,
    adapted_variables,
    adapter_count,
    adapter_names,
    adapters_of,
    arranged,
    attach,
    b_grad_norms,
    base_cast,
    inert,
    init_adapters,
    merge,
    targeted,
)

__all__ = [
    "Adapters",
    "adapted_variables",
    "adapter_count",
    "adapter_names",
    "adapters_of",
    "arranged",
    "attach",
    "b_grad_norms",
    "base_cast",
    "inert",
    "init_adapters",
    "merge",
    "targeted",
]
