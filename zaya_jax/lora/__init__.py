"""Low-rank adapters (LoRA) on every routed expert and CCA's projections (:mod:`.adapters`), HF
PEFT adapter directories both ways (:mod:`.peft`), and the parameter plan every part of a run reads
to know what trains (:mod:`.plan`)."""

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
from zaya_jax.lora.peft import PeftError, load_peft_adapter, peft_params, save_peft_adapter
from zaya_jax.lora.plan import ParameterPlan, parameter_plan

__all__ = [
    "Adapters",
    "ParameterPlan",
    "PeftError",
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
    "load_peft_adapter",
    "merge",
    "parameter_plan",
    "peft_params",
    "save_peft_adapter",
    "targeted",
]
