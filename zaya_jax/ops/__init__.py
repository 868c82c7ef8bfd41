"""Hot kernels as XLA FFI custom calls (``custom_calls/``: one C++ source per op for the CPU, one
``.cu`` for CUDA and HIP), each with a pure-JAX reference used wherever no kernel is registered.

``kernel_status()`` tells which platforms have the kernels registered.
"""

from zaya_jax.ops._registry import load as kernel_status
from zaya_jax.ops._registry import registered
from zaya_jax.ops.newton_schulz import newton_schulz_iterations, newton_schulz_iterations_reference
from zaya_jax.ops.residual_norm import (
    residual_rms_norm,
    residual_rms_norm_reference,
    sharded_residual_rms_norm,
    stack_params,
)

__all__ = [
    "kernel_status",
    "newton_schulz_iterations",
    "newton_schulz_iterations_reference",
    "registered",
    "residual_rms_norm",
    "residual_rms_norm_reference",
    "sharded_residual_rms_norm",
    "stack_params",
]
