"""Training: the driver (``loop.train``) and its parts: the run directory (``rundir``), the checks
before a run (``schedule``), the compiled train step (``compiled``), dispatch ahead (``pipeline``),
one step's judge, agree, apply and notify (``steps``), the step-outcome decisions (``decisions``),
evaluation and checkpoints (``evaluation``, ``checkpointing``), the observers (``hooks``), metrics
(``metrics``), FLOPs (``flops``) and compile-only planning (``plan``). What a run trains for is
its objective's (:mod:`zaya_jax.objectives`). See docs/ARCHITECTURE.md."""

from zaya_jax.train.loop import train

__all__ = ["train"]
