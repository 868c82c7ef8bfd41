"""What this machine runs on, for ``zaya doctor``: the JAX backend and devices, the installed GPU
plugins, the versions of the libraries a run depends on, which custom-call kernels are built for
each platform (and whether a device is there to run them), the kernel plan each ``kernels`` setting
resolves to here, the host memory allocator, and the XLA flags worth setting on it."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import platform as host
from typing import Any

import jax

from zaya_jax import allocator, ops
from zaya_jax.ops._registry import LIB_DIR
from zaya_jax.ops.kernel_plan import device_platform

_LATENCY_HIDING = (
    "schedules collectives (FSDP all-gathers, gradient reduce-scatters, the expert exchange) to "
    "overlap compute"
)
# Flags worth setting per platform, each with its reason (``zaya doctor`` prints both). Every one is
# a flag the pinned jaxlib knows (tests/test_cli.py starts JAX with all of them): an unknown flag in
# XLA_FLAGS aborts the process.
RECOMMENDED_XLA_FLAGS: dict[str, dict[str, str]] = {
    "cuda": {
        "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false": (
            "expert parallelism with mesh.expert_exchange ragged: the one-shot ragged all-to-all kernel "
            "has crashed above 32 ranks, capped throughput and corrupted a backward pass "
            "(openxla/xla#47283, #47146, #47868); the default kernel is used instead"
        ),
        "--xla_gpu_enable_latency_hiding_scheduler=true": _LATENCY_HIDING,
    },
    "rocm": {
        "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true": (
            "model.moe_impl sorted: ragged_dot becomes one hipBLASLt grouped GEMM (bf16/fp16 only) "
            "instead of a dense product per expert; slower for small groups (openxla/xla#44097), "
            "which is why moe_impl auto times both"
        ),
        "--xla_gpu_enable_latency_hiding_scheduler=true": _LATENCY_HIDING,
    },
}


# The collective timeouts recommended per platform, as config settings (RuntimeConfig maps them to
# XLA flags and RCCL / NCCL variables; docs/ROCM.md explains the numbers). A large MoE step's
# collectives finish in seconds; a link flap or a switch reboot takes up to a minute or two, which
# the transport should ride out; a collective still waiting after 20 minutes is a dead peer.
RECOMMENDED_TIMEOUTS: dict[str, dict[str, float]] = {
    "rocm": {"collective_timeout_s": 1200, "network_retry_s": 120, "network_retries": 7},
    "cuda": {"collective_timeout_s": 1200, "network_retry_s": 120, "network_retries": 7},
}


def timeout_settings(platform: str) -> tuple[list[str], list[str], dict[str, str]]:
    """The recommended timeouts on ``platform``: the config overrides, the XLA flags and the RCCL /
    NCCL variables they set."""
    from zaya_jax.config import RuntimeConfig

    values = RECOMMENDED_TIMEOUTS[platform]
    runtime = RuntimeConfig(**values)
    return [f"runtime.{k}={v:g}" for k, v in values.items()], runtime.flags(), runtime.environment()


def gpu_plugins() -> dict[str, str]:
    """The installed JAX GPU plugins (``jax-rocm*``, ``jax-cuda*``) and their versions."""
    return {
        dist.metadata["Name"]: dist.version
        for dist in metadata.distributions()
        if (dist.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax-rocm", "jax_cuda", "jax_rocm"))
    }


def kernel_report() -> dict[str, str]:
    """``ops.kernel_status()``, with a platform whose library is registered but that has no device
    here reported as ``built, no device``, one built without the device's target as ``unusable:
    <why>``, and each GPU library's targets (``registered (gfx90a)``)."""
    from zaya_jax.ops._registry import arch_mismatch, built_archs

    kernels = ops.kernel_status()
    for name, status in kernels.items():
        if status != "registered" or name == "cpu":
            continue
        try:
            jax.devices(name)
        except RuntimeError:
            status = "built, no device"
        mismatch = arch_mismatch(name)
        archs = built_archs(name)
        kernels[name] = (
            f"unusable: {mismatch}" if mismatch else status + (f" ({', '.join(archs)})" if archs else "")
        )
    return kernels


def kernel_plans() -> dict[str, dict[str, str] | str]:
    """{setting: the kernel plan it resolves to for a one-device program here} for each value of
    ``model.kernels`` and ``optim.kernels`` set together (the refusal, for ``kernel`` where a
    library is not built)."""
    from zaya_jax.config import ConfigError, ModelConfig
    from zaya_jax.ops.kernel_plan import resolve_kernel_plan

    plans: dict[str, dict[str, str] | str] = {}
    for setting in ("auto", "kernel", "reference"):
        try:
            plans[setting] = resolve_kernel_plan(ModelConfig(kernels=setting), setting).describe()
        except ConfigError as err:
            plans[setting] = f"refused: {err}"
    return plans


def platform_report(xla_flags: str | None = None) -> dict[str, Any]:
    """The whole report ``zaya doctor`` prints (``xla_flags``: default ``$XLA_FLAGS``)."""
    import flax
    import jaxlib
    import optax

    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    recommended = RECOMMENDED_XLA_FLAGS.get(device_platform(), {})
    return {
        "python": host.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "plugins": gpu_plugins(),
        "kernels": kernel_report(),
        "kernels_dir": str(LIB_DIR),
        "kernel_plan": kernel_plans(),
        "allocator": allocator.describe(),
        "recommended_xla_flags": {
            flag: {"set": flag.split("=")[0] in flags, "why": why} for flag, why in recommended.items()
        },
    }


def no_gpu_message(plugins: dict[str, str]) -> str:
    """What to check when a GPU was required and JAX runs on the CPU."""
    return (
        "a GPU was required but JAX runs on the CPU. Install the plugin "
        '(pip install -e ".[rocm]" or ".[cuda]"), check ROCR_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, '
        f"and that the driver is visible; installed plugins: {plugins or 'none'}"
    )
