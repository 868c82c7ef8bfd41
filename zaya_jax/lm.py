"""``zaya_jax.load(path)``: a model ready to evaluate, from a run, a checkpoint or an HF directory."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax import checkpoint
from zaya_jax.config import Config, ModelConfig
from zaya_jax.interop.hf import load_hf_directory
from zaya_jax.model import Zaya


@dataclasses.dataclass
class LanguageModel:
    """A ZAYA1 model and its variables. ``config`` is the model config, ``run_config`` the whole run's."""

    config: ModelConfig
    variables: dict[str, Any]
    run_config: Config | None = None
    step: int | None = None

    @functools.cached_property
    def _apply(self):
        return jax.jit(Zaya(self.config).apply)

    def logits(self, ids: Any, attention_mask: Any | None = None) -> np.ndarray:
        """Next-token logits, (batch, seq, vocab) float32. ids: (batch, seq) or (seq,) token ids;
        attention_mask: 1 for real tokens, 0 for (left) padding, as in HF.
        """
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"ids must be integer token ids of shape (batch, seq), got {ids.dtype} {ids.shape}"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.config.vocab_size}); got {ids.min()}..{ids.max()}"
            )
        mask = None
        if attention_mask is not None:
            mask = jnp.asarray(np.asarray(attention_mask).reshape(ids.shape), jnp.int32)
        logits, _ = self._apply(self.variables, jnp.asarray(ids, jnp.int32), token_mask=mask)
        return np.asarray(logits, dtype=np.float32)


def load(path: str | Path) -> LanguageModel:
    """Load a run directory (latest complete checkpoint), a step directory, or an HF ``save_pretrained``
    directory (converted in memory). Arrays land on the first local device, whatever mesh saved them.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if (path / "config.json").is_file():
        cfg, variables = load_hf_directory(path)
        return LanguageModel(cfg, jax.tree.map(jnp.asarray, variables))
    run_config, variables, step = checkpoint.restore_model(path)
    return LanguageModel(run_config.model, variables, run_config, step)
