"""``zaya_jax.load(path)``: a model ready to evaluate, from a run, a checkpoint or an HF directory."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax import checkpoint
from zaya_jax.config import Config, DataConfig, ModelConfig
from zaya_jax.data.sources import source_for_path
from zaya_jax.data.tokenizers import load_tokenizer
from zaya_jax.eval import evaluate
from zaya_jax.generate import Generation, generate
from zaya_jax.interop.hf import load_hf_directory
from zaya_jax.model import Zaya


@dataclasses.dataclass
class LanguageModel:
    """A ZAYA1 model and its variables. ``config`` is the model config, ``run_config`` the whole run's."""

    config: ModelConfig
    variables: dict[str, Any]
    run_config: Config | None = None
    step: int | None = None
    tokenizer: Any | None = None

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

    def generate(
        self,
        prompts: Any,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_tokens: Any | None = None,
        seed: int = 0,
        attention_mask: Any | None = None,
        mesh: Any | None = None,
    ) -> Generation:
        """Continue prompts with the CCA decode cache (see :mod:`zaya_jax.generate`).

        ``prompts``: a string or list of strings (needs ``self.tokenizer``), a list of token-id lists
        (left-padded here), or a (batch, seq) / (seq,) id array with an optional left-padding
        ``attention_mask``. Stops at the tokenizer's EOS (else the model's ``eos_token_id``) unless
        ``stop_tokens`` is given. Returns a :class:`Generation`; ``texts`` is filled when a tokenizer
        is known. ``mesh``: split the decode cache over its ``context`` axis (tree attention).
        """

        tok = self.tokenizer
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts):
            if tok is None:
                raise ValueError(
                    "text prompts need a tokenizer: this model has none (an HF directory without "
                    "tokenizer.json?); pass token ids or set lm.tokenizer"
                )
            prompts = [tok.encode(p).tolist() for p in prompts]
        if stop_tokens is None and tok is not None:
            stop_tokens = [tok.eos_id]
        out = generate(
            self.config,
            self.variables,
            prompts,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_tokens=stop_tokens,
            seed=seed,
            vocab_limit=tok.vocab_size if tok is not None else None,
            mesh=mesh,
        )
        if tok is None:
            return out
        return dataclasses.replace(
            out, texts=[tok.decode([t for t in row if t != tok.eos_id]) for row in out.rows()]
        )


def _find_tokenizer(path: Path, run_config: Config | None) -> Any | None:
    """The run's tokenizer, or an HF directory's tokenizer.json; None when there is none."""
    try:
        if run_config is not None:
            return load_tokenizer(run_config.data.tokenizer)
        if (path / "tokenizer.json").is_file():
            return load_tokenizer(path / "tokenizer.json")
    except Exception:  # a missing or unreadable tokenizer only disables text prompts
        return None
    return None


def load(path: str | Path) -> LanguageModel:
    """Load a run directory (latest complete checkpoint), a step directory, or an HF ``save_pretrained``
    directory (converted in memory). Arrays land on the first local device, whatever mesh saved them.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if (path / "config.json").is_file():
        cfg, variables = load_hf_directory(path)
        return LanguageModel(cfg, jax.tree.map(jnp.asarray, variables), tokenizer=_find_tokenizer(path, None))
    run_config, variables, step = checkpoint.restore_model(path)
    return LanguageModel(run_config.model, variables, run_config, step, _find_tokenizer(path, run_config))


def evaluate_path(
    path: str | Path, data_paths: Sequence[str] = (), tokenizer: str | None = None, **kwargs: Any
) -> dict[str, Any]:
    """:func:`evaluate` on a run, checkpoint or HF directory. Without ``data_paths`` the run's own
    data config (or the built-in corpus) is used, held-out split; with them, all of those files."""
    lm = load(path)
    data = lm.run_config.data if lm.run_config is not None else DataConfig()
    if data_paths:
        data = dataclasses.replace(data, sources=tuple(source_for_path(p) for p in data_paths))
        kwargs.setdefault("split", "all")
    return evaluate(lm, data, tokenizer=tokenizer, **kwargs)
