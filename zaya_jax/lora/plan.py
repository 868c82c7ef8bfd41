"""The parameter plan: which parameters a run trains and which it holds frozen, built once from the
config (:func:`parameter_plan`) and read by everything that must know.

A run trains either every parameter, or low-rank adapters on a frozen base (the ``lora`` section).
The difference touches the whole stack: the variables a run starts from, the shardings of its
state, the optimizer's groups, what a checkpoint writes and how a restore joins it back, where a
frozen base comes from (``train.init_from``) and how it is checked, the reference a preference or
KL term scores against, and the guard that stops a run whose adapters can receive no gradient. Each
of those is a method here; the driver (``zaya_jax.train``), checkpointing, the programs, the
objectives and the layout read this record and never the ``lora`` section
(``tests/lora/test_plan.py`` confines ``lora`` names to ``config/`` and ``lora/``). The record is
small and frozen, like :class:`~zaya_jax.ops.kernel_plan.KernelPlan`; the model itself needs none
of it: it folds whatever adapters its parameters carry (:mod:`zaya_jax.model.lowrank`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from zaya_jax.config import Config, ConfigError, LoraConfig, ModelConfig
from zaya_jax.lora.adapters import (
    adapted_variables,
    adapter_names,
    adapters_of,
    arranged,
    b_grad_norms,
    base_cast,
    boxed_with_adapters,
)
from zaya_jax.lora.peft import save_peft_adapter
from zaya_jax.model.counts import short_count
from zaya_jax.model.lowrank import adapter_part, base_part, join, split, switched_off
from zaya_jax.model.transformer import boxed_abstract_variables, init_variables
from zaya_jax.optim.groups import LeafGroup

Params = Mapping[str, Any]

# The train step's metric holding each adapter's B-gradient norm (the inert-adapter guard's input).
B_GRAD_NORMS = "lora_b_grad_norm"

# A run's adapters are drawn from this fold of its init key, so the base's draw is the same with
# and without them.
_ADAPTER_KEY = 0x10A


@dataclasses.dataclass(frozen=True)
class ParameterPlan:
    """What a run trains. ``low_rank``: the adapters trained on a frozen base, or None (every
    parameter trains); ``init_from``: where that base comes from (``train.init_from``)."""

    low_rank: LoraConfig | None = None
    init_from: str | None = None

    @property
    def frozen_base(self) -> bool:
        """Whether a frozen base is held apart from what trains."""
        return self.low_rank is not None

    # ---- leaves ----
    def fresh_variables(self, model: ModelConfig, key: jax.Array) -> dict[str, Any]:
        """Step 0's variables: the model's initialisation, with a frozen base its matrices in the
        base dtype carrying fresh adapters (``B`` zero: the function of the base)."""
        variables = init_variables(model, key)
        if self.low_rank is None:
            return variables
        return adapted_variables(variables, self.low_rank, jax.random.fold_in(key, _ADAPTER_KEY))

    def boxed(self, model: ModelConfig) -> Mapping[str, Any]:
        """The variables' shapes with their logical axes (``nn.LogicallyPartitioned`` leaves), the
        adapters' factors included, for the layout's shardings."""
        boxed = boxed_abstract_variables(model)
        return boxed if self.low_rank is None else boxed_with_adapters(boxed, self.low_rank)

    def split(self, params: Params) -> tuple[dict[str, Any], dict[str, Any]]:
        """(what trains, what is frozen), each keeping the paths of ``params``."""
        return split(params) if self.frozen_base else (dict(params), {})

    def join(self, trained: Params, frozen: Params) -> dict[str, Any]:
        """The inverse of :meth:`split`."""
        return join(trained, frozen) if frozen else dict(trained)

    def trained_count(self, model: ModelConfig) -> int:
        """How many numbers train (every parameter, or the adapters' factors)."""
        trained = self.split(nn.unbox(self.boxed(model))["params"])[0]
        return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(trained))

    # ---- optimizer ----
    def optimizer_groups(self, trained: Params, model_groups: Callable[[], Any]) -> Any:
        """The Muon/AdamW grouping of what trains: the model's (``model_groups()``) when every
        parameter trains; adapters are all AdamW without weight decay (a rank-r factor is no
        hidden matrix for Muon)."""
        if not self.frozen_base:
            return model_groups()
        return jax.tree.map(lambda _: LeafGroup("adamw", None, False), trained)

    # ---- checkpoints ----
    def saved(self, params: Params) -> dict[str, Any]:
        """What a checkpoint writes of ``params``: all of them, or the adapters alone (the base is
        recorded, :meth:`base_record`, not copied into every step)."""
        return adapter_part(params) if self.frozen_base else dict(params)

    def restored(self, saved: Params, like: Params) -> dict[str, Any]:
        """The parameters from what a checkpoint held and the state it restores into (whose frozen
        base was loaded first)."""
        return join(saved, base_part(like)) if self.frozen_base else dict(saved)

    def frozen(self, params: Params) -> dict[str, Any] | None:
        """The frozen base of ``params`` as held (what a checkpoint's base record fingerprints), or
        None."""
        return base_part(params) if self.frozen_base else None

    def base_record(self) -> dict[str, Any] | None:
        """What a checkpoint records of its frozen base besides its fingerprint: where it came from
        and the dtype it is held in; None when nothing is frozen."""
        if self.low_rank is None:
            return None
        return {"init_from": self.init_from, "dtype": self.low_rank.base_dtype}

    def base_from(self, source: Params, params: Params) -> dict[str, Any]:
        """The frozen base that ``params`` (a restored step's adapters) run on, from the parameters
        of ``train.init_from`` (``source``), taken as the run took them and held in the base dtype."""
        adapters = adapter_part(params)
        assert self.low_rank is not None, "base_from is for a plan with a frozen base"
        return base_cast(base_part(arranged(source, adapters)), self.low_rank.base_dtype)

    # ---- starting points and references ----
    def arranged(self, source: Params, params: Params) -> dict[str, Any]:
        """``source``'s parameters (``train.init_from``) as the start of a state whose parameters
        are ``params``: the base under fresh adapters, or a source's adapters continued where they
        match (:func:`zaya_jax.lora.arranged`); merged when every parameter trains."""
        return arranged(source, adapter_part(params) if self.frozen_base else {})

    def reference(self, params: Params) -> dict[str, Any] | None:
        """The reference model's parameters that ``params`` themselves give (a frozen base: the
        same arrays with every adapter off, ``W + s A 0``), or None: the reference is the starting
        weights, kept apart."""
        return switched_off(params) if self.frozen_base else None

    # ---- the inert-adapter guard ----
    @property
    def guards_inert_adapters(self) -> bool:
        """Whether the first step's gradients are checked for adapters that can never train."""
        return self.frozen_base

    def b_grad_norms(self, grads: Params) -> jax.Array:
        """Each adapter's ``B``-gradient norm (traced in the train step; ``grads`` of what trains)."""
        return b_grad_norms(grads)

    def refuse_inert(self, norms: Any, step: int) -> bool:
        """At the first step with any gradient, refuse (one :class:`ConfigError`) adapters whose
        ``B`` received none: with the base frozen they would never train (unslothai/unsloth-zoo#1242
        attached expert adapters that received none). Returns whether the check was made."""
        norms = np.asarray(norms)
        if self.low_rank is None or not np.any(norms > 0):
            return False
        names = adapter_names(self.low_rank)
        inert = [name for name, norm in zip(names, norms, strict=True) if not norm > 0]
        if inert:
            raise ConfigError(
                f"the LoRA adapters of {', '.join(inert)} received no gradient at step {step}, so they would "
                "never train: the frozen base gives them none (a base whose CCA temperature is 0, a freshly "
                "initialised one, attends uniformly, and q_proj/k_proj then have no gradient) or no token "
                "reaches them. Start from trained weights (train.init_from) or drop their role from "
                f"lora.targets={list(self.low_rank.targets)}"
            )
        return True

    # ---- reports and exports ----
    def describe(self, model: ModelConfig, total: int) -> str:
        """One line on what trains (``total``: the model's parameters), empty when everything does."""
        if self.low_rank is None:
            return ""
        low_rank, trained = self.low_rank, self.trained_count(model)
        return (
            f"LoRA rank {low_rank.rank} (scale {low_rank.scale:g}) on {', '.join(low_rank.targets)}: "
            f"{short_count(trained)} trained parameters ({100 * trained / total:.2f}% of the model), "
            f"the base frozen in {low_rank.base_dtype}"
        )

    def save_adapter(
        self, directory: str | Path, model: ModelConfig, params: Params, base_model: str | None = None
    ) -> Path:
        """Write the adapters ``params`` carry as an HF PEFT adapter directory
        (:func:`zaya_jax.lora.peft.save_peft_adapter`); refused when every parameter trains."""
        if self.low_rank is None:
            raise ValueError("this run trains every parameter (lora.rank is 0): it has no adapters to export")
        return save_peft_adapter(directory, model, adapters_of(params), self.low_rank, base_model=base_model)


EVERY_PARAMETER = ParameterPlan()
"""The plan of a run that trains every parameter (the default wherever no plan is handed in)."""


def parameter_plan(cfg: Config) -> ParameterPlan:
    """The plan of ``cfg``: adapters on a frozen base when ``lora`` is enabled, else every
    parameter."""
    if not cfg.lora.enabled:
        return EVERY_PARAMETER
    return ParameterPlan(cfg.lora, cfg.train.init_from)
