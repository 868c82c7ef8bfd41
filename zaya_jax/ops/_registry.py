"""Loading and registering the custom-call libraries built from ``custom_calls/``.

Each platform has its own library (``_lib/libzaya_kernels_{cpu,cuda,rocm}.so``) exporting the same
handler symbols; they are registered with XLA under prefixed target names, per platform. A missing
or unloadable library only means the pure-JAX reference runs on that platform.
"""

from __future__ import annotations

import ctypes
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

_lock = threading.Lock()
_status: dict[str, str] = {}


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
            except (OSError, AttributeError, RuntimeError, ValueError) as err:  # e.g. no ROCm runtime here
                _status[platform] = f"failed: {err}"
                continue
            _status[platform] = "registered"
        return dict(_status)


def registered(platform: str) -> bool:
    """Whether the custom calls are registered for a jax platform name (cpu, cuda, rocm)."""
    return load().get(platform) == "registered"
