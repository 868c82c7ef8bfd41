"""Training: the driver (``loop.train``) and its parts: the run directory (``rundir``), batch ramp
and curriculum (``schedule``), compiled programs (``programs``), the pure step (``step``), the
step-outcome policy (``policy``), checkpoint cadence and faults (``hooks``), metrics (``metrics``),
FLOPs (``flops``) and compile-only planning (``plan``). See docs/ARCHITECTURE.md."""

from zaya_jax.train.loop import train

__all__ = ["train"]
