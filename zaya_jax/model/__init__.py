"""Flax (Linen) modules of the ZAYA1 architecture; see ``zaya_jax.model.transformer.Zaya``."""

from zaya_jax.model.counts import param_counts
from zaya_jax.model.router import BALANCING
from zaya_jax.model.stack import positions_in_document
from zaya_jax.model.transformer import Zaya, abstract_variables, init_cache, init_variables

__all__ = [
    "BALANCING",
    "Zaya",
    "abstract_variables",
    "init_cache",
    "init_variables",
    "param_counts",
    "positions_in_document",
]
