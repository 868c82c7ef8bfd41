"""The kernel plan (``zaya_jax.ops.kernel_plan``): what each ``kernels`` setting runs on this CPU,
that ``reference`` programs contain no custom call and ``auto`` ones the CPU kernels, and the
refusals that name what to change. That a run records its plan in the start event:
``tests/train/test_loop.py``."""

from __future__ import annotations

import re
import warnings

import pytest

from tests.fixtures import MINI
from zaya_jax import objectives, ops
from zaya_jax.config import ConfigError, load_config
from zaya_jax.ops import kernel_plan
from zaya_jax.ops.kernel_plan import KernelPlan, resolve_kernel_plan
from zaya_jax.ops.platform import planning_for

# Two of the CPU attention call's 64-key blocks: the call runs, not the dense form of one block.
SMALL = [*MINI, "train.seq_len=128"]
# What XLA itself writes as custom calls in a lowered program (sharding annotations), not kernels.
XLA_ANNOTATIONS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}
CPU_KERNELS = {"zaya_attention_fwd", "zaya_cca_qk_fwd", "zaya_grouped_matmul", "zaya_newton_schulz_cpu"}

needs_cpu_kernels = pytest.mark.skipif(
    not ops.registered("cpu"), reason="the CPU kernel library is not built (python custom_calls/build.py)"
)


def _cfg(*overrides: str):
    return load_config("tiny", [*SMALL, *overrides])


def _custom_call_targets(cfg) -> set[str]:
    """The custom-call targets of ``cfg``'s train step, lowered (not compiled)."""
    text = objectives.build_programs(cfg).lower_train_step().as_text()
    return set(re.findall(r"custom_call @([\w$.]+)", text))


def test_reference_programs_contain_no_custom_call():
    cfg = _cfg("model.kernels=reference", "optim.kernels=reference")
    assert _custom_call_targets(cfg) <= XLA_ANNOTATIONS


@needs_cpu_kernels
def test_auto_programs_run_the_cpu_kernels():
    """The other side of the test above: on one CPU device ``auto`` takes every CPU kernel but the
    fused norm (slower than XLA there), and the lowered step contains their custom calls."""
    cfg = _cfg()
    plan = resolve_kernel_plan(cfg.model, cfg.optim.kernels)
    assert plan == KernelPlan("cpu", "cpu", "kernel", "kernel", "jax", "kernel")
    targets = _custom_call_targets(cfg)
    assert targets >= CPU_KERNELS
    assert "zaya_residual_rms_norm_fwd" not in targets


@needs_cpu_kernels
def test_kernel_adds_the_fused_norm_and_reference_runs_none():
    model = _cfg("model.kernels=kernel").model
    assert resolve_kernel_plan(model, "kernel").custom_calls() == list(kernel_plan.OPS)
    reference = resolve_kernel_plan(_cfg("model.kernels=reference").model, "reference")
    assert reference.custom_calls() == [] and reference.attention == "blocked"


@needs_cpu_kernels
def test_the_plan_follows_devices_dtype_and_the_planned_platform():
    model = _cfg().model
    # XLA's partitioner cannot split a custom call: a mesh keeps the blocked attention, and with it
    # the JAX CCA steps; the grouped GEMM runs per device and stays.
    on_two = resolve_kernel_plan(model, devices=2)
    assert (on_two.attention, on_two.cca_qk, on_two.moe_gemm) == ("blocked", "jax", "kernel")
    bf16 = resolve_kernel_plan(_cfg("model.dtype=bfloat16").model)
    assert (bf16.cca_qk, bf16.moe_gemm) == ("jax", "jax")  # the CPU calls take float32 only
    with planning_for("gpu"):  # a GPU program planned here takes XLA's ops, never a CPU kernel
        planned = resolve_kernel_plan(_cfg("model.kernels=kernel").model, "kernel")
    assert planned.platform == "gpu" and planned.custom_calls() == []


def test_kernel_is_refused_in_one_line_where_the_library_is_not_built(monkeypatch):
    monkeypatch.setattr(kernel_plan._registry, "registered_target", lambda platform, target: False)
    with pytest.raises(
        ConfigError, match=r"model.kernels=kernel needs the attention custom call on cpu.*auto"
    ):
        resolve_kernel_plan(_cfg("model.kernels=kernel").model)
    with pytest.raises(ConfigError, match=r"optim.kernels=kernel needs the newton_schulz custom call"):
        resolve_kernel_plan(_cfg().model, "kernel")
    # auto falls back to XLA's ops, with nothing to refuse
    assert resolve_kernel_plan(_cfg().model).custom_calls() == []


def test_settings_that_contradict_each_other_are_config_errors(monkeypatch):
    with pytest.raises(
        ConfigError, match=r"attention_impl=cpu is a custom call and model\.kernels=reference"
    ):
        _cfg("model.kernels=reference", "model.attention_impl=cpu")
    with pytest.raises(ConfigError, match=r"model\.kernels='fast' is not allowed"):
        _cfg("model.kernels=fast")
    # A GPU whose library is built: its fused Newton-Schulz runs the standard iteration only.
    monkeypatch.setattr(kernel_plan._registry, "registered_target", lambda platform, target: True)
    model = _cfg().model
    assert resolve_kernel_plan(model, "kernel", platform="cuda").newton_schulz == "kernel"
    with pytest.raises(ConfigError, match=r"optim\.ns_formulation=gram: the GPU's fused Newton-Schulz"):
        resolve_kernel_plan(model, "kernel", platform="cuda", ns_formulation="gram")


def test_configs_saved_with_the_old_value_custom_still_load():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = _cfg("model.kernels=custom", "optim.kernels=custom")
    assert (cfg.model.kernels, cfg.optim.kernels) == ("kernel", "kernel")
    assert any("model.kernels=custom is now model.kernels=kernel" in str(w.message) for w in caught)


def test_how_the_model_is_computed_is_not_its_architecture():
    """A run resumes with other kernels (RunDir compares architectures), not another width."""
    base = _cfg().model
    assert _cfg("model.kernels=reference", "model.remat=full").model.architecture() == base.architecture()
    assert _cfg("model.hidden_size=64").model.architecture() != base.architecture()
