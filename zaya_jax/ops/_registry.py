"""Loading and registering the custom-call libraries built from ``custom_calls/``.

Each platform has its own library (``_lib/libzaya_kernels_{cpu,cuda,rocm}.so``) exporting the same
handler symbols; they are registered with XLA under prefixed target names, per platform. A missing
or unloadable library only means the pure-JAX reference runs on that platform. So does a GPU
library built without the live device's target (``build.json`` beside the libraries lists the
targets each was built for; e.g. a gfx90a-only ROCm library on an MI300X, gfx942): launching its
kernels there would fail at run time.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
from pathlib import Path

import jax

LIB_DIR = Path(os.environ.get("ZAYA_KERNELS_DIR", Path(__file__).resolve().parent / "_lib"))
# jax platform name -> (XLA platform name for registration, library file)
PLATFORMS = {
    "cpu": ("cpu", "libzaya_kernels_cpu.so"),
    "cuda": ("CUDA", "libzaya_kernels_cuda.so"),
    "rocm": ("ROCM", "libzaya_kernels_rocm.so"),
}
# target name -> exported handler symbol
TARGETS = {
    "zaya_residual_rms_norm_fwd": "ZayaResidualRmsNormFwd",
    "zaya_residual_rms_norm_bwd": "ZayaResidualRmsNormBwd",
    "zaya_newton_schulz": "ZayaNewtonSchulz",
}
# targets only some platforms' libraries export: platform -> {target name -> symbol}
PLATFORM_TARGETS = {
    "cpu": {
        "zaya_attention_fwd": "ZayaAttentionFwd",
        "zaya_attention_bwd": "ZayaAttentionBwd",
        "zaya_grouped_matmul": "ZayaGroupedMatmul",
        "zaya_grouped_matmul_dw": "ZayaGroupedMatmulDw",
        "zaya_cca_qk_fwd": "ZayaCcaQkFwd",
        "zaya_cca_qk_bwd": "ZayaCcaQkBwd",
        "zaya_newton_schulz_cpu": "ZayaNewtonSchulzCpu",
    },
}

_lock = threading.Lock()
_status: dict[str, str] = {}
_targets: dict[str, set[str]] = {}  # platform -> the targets registered for it


def load() -> dict[str, str]:
    """Register every built library once per process; returns {platform: status}, status being
    ``registered``, ``not built`` or ``failed: <reason>``."""
    with _lock:
        if _status:
            return dict(_status)
        for platform, (xla_platform, filename) in PLATFORMS.items():
            path = LIB_DIR / filename
            if not path.exists():
                _status[platform] = "not built"
                continue
            try:
                lib = ctypes.cdll.LoadLibrary(str(path))
                for target, symbol in TARGETS.items():
                    jax.ffi.register_ffi_target(
                        target, jax.ffi.pycapsule(getattr(lib, symbol)), platform=xla_platform
                    )
                _targets[platform] = set(TARGETS)
                for target, symbol in PLATFORM_TARGETS.get(platform, {}).items():
                    if hasattr(lib, symbol):  # a library built before the target existed lacks it
                        jax.ffi.register_ffi_target(
                            target, jax.ffi.pycapsule(getattr(lib, symbol)), platform=xla_platform
                        )
                        _targets[platform].add(target)
            except (OSError, AttributeError, RuntimeError, ValueError) as err:  # e.g. no ROCm runtime here
                _status[platform] = f"failed: {err}"
                continue
            _status[platform] = "registered"
        return dict(_status)


def built_archs(platform: str) -> list[str] | None:
    """The device targets the platform's library was built for (``build.json``), None if unknown."""
    try:
        record = json.loads((LIB_DIR / "build.json").read_text())
    except (OSError, ValueError):
        return None
    return record.get(platform, {}).get("archs")


@functools.cache
def arch_mismatch(platform: str) -> str | None:
    """Why the platform's library cannot run on the live device, or None: an AMD device whose
    target (``gfx942``) the library was not built for."""
    archs = built_archs(platform)
    if platform != "rocm" or not archs:
        return None
    try:
        device = jax.devices(platform)[0]
    except RuntimeError:
        return None
    arch = str(getattr(device, "compute_capability", "") or "").split(":")[0]
    if not arch.startswith("gfx") or arch in archs:
        return None
    return (
        f"built for {', '.join(archs)}, this device is {arch}: rebuild with a hipcc that knows {arch} "
        f"(ZAYA_HIP_ARCHS={arch} python custom_calls/build.py --gpu rocm)"
    )


def registered(platform: str) -> bool:
    """Whether the custom calls are registered for a jax platform name (cpu, cuda, rocm) and built
    for its device."""
    return load().get(platform) == "registered" and arch_mismatch(platform) is None


def registered_target(platform: str, target: str) -> bool:
    """Whether one target is registered for a jax platform name (a platform-specific one may be
    missing from an older build of the library)."""
    return registered(platform) and target in _targets.get(platform, set())
