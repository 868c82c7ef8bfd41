"""What this machine runs on, for ``zaya doctor``: the JAX backend and devices, the installed GPU
plugins, the versions of the libraries a run depends on, which custom-call kernels are built for
each platform (and whether a device is there to run them), and the XLA flags worth setting on it."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import platform as host
from typing import Any

import jax

from zaya_jax import ops
from zaya_jax.ops._registry import LIB_DIR

# Flags worth setting per platform (MoE on MI300X: ragged_dot as hipBLASLt grouped GEMM, bf16).
RECOMMENDED_XLA_FLAGS: dict[str, list[str]] = {
    "rocm": ["--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true"],
}


def gpu_plugins() -> dict[str, str]:
    """The installed JAX GPU plugins (``jax-rocm*``, ``jax-cuda*``) and their versions."""
    return {
        dist.metadata["Name"]: dist.version
        for dist in metadata.distributions()
        if (dist.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax-rocm", "jax_cuda", "jax_rocm"))
    }


def kernel_report() -> dict[str, str]:
    """``ops.kernel_status()``, with a platform whose library is registered but that has no device
    here reported as ``built, no device``."""
    kernels = ops.kernel_status()
    for name, status in kernels.items():
        if status == "registered" and name != "cpu":
            try:
                jax.devices(name)
            except RuntimeError:
                kernels[name] = "built, no device"
    return kernels


def device_platform() -> str:
    """``rocm``, ``cuda`` or ``cpu``: the platform of the default devices (ROCm told apart from CUDA
    by the client's platform version, as both report ``gpu`` on some jaxlib versions)."""
    if jax.default_backend() == "cpu":
        return "cpu"
    device = jax.devices()[0]
    try:
        version = str(device.client.platform_version).lower()
    except AttributeError:
        version = ""
    return "rocm" if "rocm" in version else device.platform


def platform_report(xla_flags: str | None = None) -> dict[str, Any]:
    """The whole report ``zaya doctor`` prints (``xla_flags``: default ``$XLA_FLAGS``)."""
    import flax
    import jaxlib
    import optax

    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    recommended = RECOMMENDED_XLA_FLAGS.get(device_platform(), [])
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
        "recommended_xla_flags": {flag: flag.split("=")[0] in flags for flag in recommended},
    }


def no_gpu_message(plugins: dict[str, str]) -> str:
    """What to check when a GPU was required and JAX runs on the CPU."""
    return (
        "a GPU was required but JAX runs on the CPU. Install the plugin "
        '(pip install -e ".[rocm]" or ".[cuda]"), check ROCR_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, '
        f"and that the driver is visible; installed plugins: {plugins or 'none'}"
    )
