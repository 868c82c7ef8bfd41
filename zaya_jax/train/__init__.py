"""Training: the train state and pure step (``step``), the loop (``train``), metrics and FLOPs."""

from zaya_jax.train.loop import train

__all__ = ["train"]
