"""Flax (Linen) modules of the ZAYA1 architecture; see ``zaya_jax.model.transformer.Zaya``."""

from zaya_jax.model.router import BALANCING
from zaya_jax.model.transformer import Zaya, positions_in_document

__all__ = ["BALANCING", "Zaya", "positions_in_document"]
