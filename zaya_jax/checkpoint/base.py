"""The base model of a LoRA run's checkpoint: a step saves the adapters only (``params`` holds the
``lora`` subtrees, :mod:`zaya_jax.model.lowrank`) and a ``base`` item recording where the frozen
base came from (``train.init_from``), the dtype it was held in and its fingerprint (bit-exact,
:func:`~zaya_jax.checkpoint.fingerprint.digest`). Resuming or loading such a step first loads the
base and checks it against the record, so adapters never run on other weights in silence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from zaya_jax.checkpoint.fingerprint import digest
from zaya_jax.checkpoint.store import BaseMismatchError, CheckpointCorruptError
from zaya_jax.files import read_json
from zaya_jax.lora.plan import ParameterPlan

BASE_ITEM = "base"


def base_record(parameters: ParameterPlan, params: Any) -> dict[str, Any] | None:
    """What a step records about the frozen base of ``params`` (the parameter plan's: where it came
    from, its dtype) and its fingerprint; None when the plan freezes nothing."""
    record, frozen = parameters.base_record(), parameters.frozen(params)
    if record is None or frozen is None:
        return None
    return {**record, "fingerprint": digest({"params": frozen})}


def saved_base(step_dir: Path) -> dict[str, Any] | None:
    """The base record of a step, None for a step of a run without adapters."""
    item = step_dir / BASE_ITEM
    if not item.is_dir():
        return None
    record = read_json(item / "metadata", "a LoRA checkpoint's base record")
    if not isinstance(record, dict) or "fingerprint" not in record:
        raise CheckpointCorruptError(f"{item / 'metadata'} does not hold a base record with a fingerprint")
    return record


def check_base(step_dir: Path, fingerprint: str) -> None:
    """Refuse a base of ``fingerprint`` (:func:`~zaya_jax.checkpoint.fingerprint.digest` of
    ``{"params": base}``) for the adapters of ``step_dir`` unless the step recorded that one."""
    record = saved_base(step_dir)
    if record is None:
        raise CheckpointCorruptError(
            f"{step_dir} holds LoRA adapters but no {BASE_ITEM}/ record of the base model they belong to"
        )
    if fingerprint != record["fingerprint"]:
        raise BaseMismatchError(
            f"the adapters of {step_dir} were trained on a base with fingerprint {record['fingerprint']} "
            f"(train.init_from={record.get('init_from')}, held in {record.get('dtype')}), but the base "
            f"loaded now has {fingerprint}: the weights at {record.get('init_from')} changed, or "
            "lora.base_dtype differs. Restore the original base weights (and lora.base_dtype), or start "
            "a new run from these adapters merged (zaya convert ... --merge)"
        )


def save_args(record: dict[str, Any]) -> dict[str, ocp.args.CheckpointArgs]:
    return {BASE_ITEM: ocp.args.JsonSave(record)}
