"""The kernel plan: which implementation runs each hot op of one program, decided once.

Two settings choose, with the same three values: ``model.kernels`` for the model's ops (attention
when ``model.attention_impl`` is ``auto``, CCA's query/key steps, the MoE GEMMs, the attention
merge + norm) and ``optim.kernels`` for Muon's Newton-Schulz:

- ``reference``: pure JAX. The program contains no custom call (``tests/ops/test_kernel_plan.py``
  lowers one and looks).
- ``auto`` (the default): the custom calls measured faster than XLA on the platform
  (``bench/RESULTS.md``): on a CPU the attention (one-device programs), CCA query/key, grouped-GEMM
  and per-leaf Newton-Schulz calls, not the fused norm (1.2-1.7x slower than XLA there); on GPUs
  XLA's ops and the Pallas/cuDNN attention only where ``model.attention_impl`` names one.
- ``kernel``: the custom call of every op that has one on the platform, the fused norm included;
  refused in one line where the kernel library is not built for it.

:func:`resolve_kernel_plan` is the one place that asks whether a kernel library is built. The
plan is resolved where a program's devices are known (:func:`zaya_jax.parallel.make_layout` for
training and evaluation, the rollout engine and the static sampler for generation), recorded in
the run's ``start`` event and in ``zaya doctor``, and handed down: to the model as
``ModelHooks.kernels``, to Muon as its Newton-Schulz implementation. A model built without a plan
runs :func:`reference_plan` (pure JAX, an explicit ``model.attention_impl`` honoured).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from zaya_jax.config import ConfigError, ModelConfig
from zaya_jax.ops import _registry
from zaya_jax.ops.platform import planning_target

Setting = Literal["auto", "kernel", "reference"]
Impl = Literal["jax", "kernel"]

# Attention implementations that are custom calls on the device that runs them.
CUSTOM_CALL_ATTENTION = ("cpu", "pallas", "cudnn")

# The CPU library's targets behind each op of the plan.
_CPU_TARGETS = {
    "attention": ("zaya_attention_fwd", "zaya_attention_bwd"),
    "cca_qk": ("zaya_cca_qk_fwd", "zaya_cca_qk_bwd"),
    "moe_gemm": ("zaya_grouped_matmul", "zaya_grouped_matmul_dw"),
    "norm": ("zaya_residual_rms_norm_fwd", "zaya_residual_rms_norm_bwd"),
    "newton_schulz": ("zaya_newton_schulz_cpu",),
}
# GPU libraries export the shared targets only: the fused norm and Newton-Schulz.
_GPU_TARGETS = {
    "norm": _CPU_TARGETS["norm"],
    "newton_schulz": ("zaya_newton_schulz",),
}


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What one program runs for each hot op. ``attention`` is an implementation of
    :func:`zaya_jax.ops.attention.attention` (``blocked``, ``dense``, ``pallas``, ``cudnn`` or
    ``cpu``, the CPU custom call); every other op is ``jax`` (XLA's ops) or ``kernel`` (the
    platform's custom call: on a CPU the CPU library's, on a GPU the fused norm and the fused
    Newton-Schulz). ``platform``: the jax platform the plan is for (``cpu``, ``cuda``, ``rocm``,
    or ``gpu`` while a GPU program is planned on a CPU)."""

    platform: str = "cpu"
    attention: str = "blocked"
    cca_qk: Impl = "jax"
    moe_gemm: Impl = "jax"
    norm: Impl = "jax"
    newton_schulz: Impl = "jax"

    def custom_calls(self) -> list[str]:
        """The ops that run a custom call under this plan."""
        ops = ["attention"] if self.attention in CUSTOM_CALL_ATTENTION else []
        return ops + [
            op for op in ("cca_qk", "moe_gemm", "norm", "newton_schulz") if getattr(self, op) == "kernel"
        ]

    def describe(self) -> dict[str, str]:
        """{op: what runs}, as the start event and ``zaya doctor`` report it."""
        return {"platform": self.platform, **{op: getattr(self, op) for op in OPS}}


OPS = ("attention", "cca_qk", "moe_gemm", "norm", "newton_schulz")


def reference_plan(model: ModelConfig | None = None, platform: str = "cpu") -> KernelPlan:
    """Pure JAX: no availability asked; an explicit ``model.attention_impl`` is kept (``auto``
    runs the blocked kernel)."""
    attention = "blocked" if model is None or model.attention_impl == "auto" else model.attention_impl
    return KernelPlan(platform=platform, attention=attention)


def device_platform(device: jax.Device | None = None) -> str:
    """``rocm``, ``cuda`` or ``cpu``: the platform of ``device`` (default: the first default
    device), ROCm told apart from CUDA by the client's platform version, as both report ``gpu`` on
    some jaxlib versions (the kernel libraries are registered per ``rocm`` / ``cuda``)."""
    device = device if device is not None else jax.devices()[0]
    if device.platform != "gpu":
        return device.platform
    try:
        version = str(device.client.platform_version).lower()
    except AttributeError:
        version = ""
    return "rocm" if "rocm" in version else "cuda"


def program_platform(devices: list[jax.Device] | None = None) -> str:
    """The platform a program is built for: the planned target inside
    :func:`~zaya_jax.ops.platform.planning_for` (``gpu`` when it is not the backend's), else the
    devices' (default: the backend's)."""
    backend = device_platform(devices[0] if devices else None)
    if planning_target() == "gpu" and backend == "cpu":
        return "gpu"
    return backend


def _built(op: str, platform: str) -> bool:
    targets = (_CPU_TARGETS if platform == "cpu" else _GPU_TARGETS).get(op, ())
    return bool(targets) and all(_registry.registered_target(platform, t) for t in targets)


def _why_not_built(op: str, platform: str, setting: str) -> str:
    if op not in (_CPU_TARGETS if platform == "cpu" else _GPU_TARGETS):
        return f"{platform} has no custom call for {op}"
    status = _registry.load().get(platform, "not built")
    mismatch = _registry.arch_mismatch(platform) if status == "registered" else None
    why = mismatch or (f"the {platform} kernel library is {status}" if status != "registered" else "")
    why = why or f"the {platform} kernel library predates the {op} kernel"
    return (
        f"{setting}=kernel needs the {op} custom call on {platform}, but {why}: build it "
        f"(python custom_calls/build.py; `zaya doctor` says what is built) or set {setting}=auto"
    )


def resolve_kernel_plan(
    model: ModelConfig,
    optim_kernels: Setting = "auto",
    *,
    devices: int = 1,
    platform: str | None = None,
    ns_formulation: str = "auto",
) -> KernelPlan:
    """The plan of a program over ``devices`` devices of ``platform`` (default:
    :func:`program_platform`) for ``model.kernels`` / ``model.attention_impl`` and
    ``optim_kernels`` (``optim.kernels``, with ``optim.ns_formulation``). Raises
    :class:`ConfigError` for ``kernel`` where a needed kernel is not built for the platform this
    process runs (a GPU program planned on a CPU takes XLA's ops instead), and for the GPU's fused
    Newton-Schulz asked for the Gram formulation it does not run."""
    platform = platform or program_platform()
    runs_here = platform == device_platform()
    cpu = platform == "cpu"

    def choose(op: str, applies: bool = True, default: bool = True, setting: str = "model.kernels") -> Impl:
        """``kernel`` where the op has one here and the setting takes it (``kernel``, or ``auto``
        with ``default``), else ``jax``."""
        want = (model.kernels if setting == "model.kernels" else optim_kernels) == "kernel"
        if not applies or not (want or default):
            return "jax"
        if _built(op, platform):
            return "kernel"
        if want and runs_here:
            raise ConfigError(_why_not_built(op, platform, setting))
        return "jax"

    if model.kernels == "reference":
        plan = reference_plan(model, platform)
    else:
        attention = model.attention_impl
        if attention == "auto":
            # A custom call cannot be split by XLA's partitioner (it would gather every operand),
            # and on GPUs the Pallas kernel is unmeasured: both keep the blocked kernel.
            attention = "cpu" if choose("attention", cpu and devices == 1) == "kernel" else "blocked"
        elif attention == "cpu" and choose("attention", cpu) == "jax":
            attention = "blocked"  # what the CPU call's op runs on another device or unbuilt
        float32 = model.dtype == "float32"  # the CPU GEMM and CCA calls take float32 only
        plan = KernelPlan(
            platform=platform,
            attention=attention,
            cca_qk=choose("cca_qk", attention == "cpu" and float32),
            moe_gemm=choose("moe_gemm", cpu and float32),
            norm=choose("norm", default=False),
        )
    # optim.kernels: the per-leaf call on a CPU (auto, kernel); on a GPU the fused call for kernel
    # only (auto keeps XLA's loop there).
    if optim_kernels == "reference":
        newton_schulz: Impl = "jax"
    else:
        newton_schulz = choose("newton_schulz", default=cpu, setting="optim.kernels")
    if newton_schulz == "kernel" and not cpu and ns_formulation == "gram":
        raise ConfigError(
            "optim.ns_formulation=gram: the GPU's fused Newton-Schulz call runs the standard iteration; "
            "use optim.ns_formulation=auto (or standard), or optim.kernels=auto"
        )
    return dataclasses.replace(plan, newton_schulz=newton_schulz)
