"""zaya-jax: a JAX/XLA training stack for ZAYA1-style Mixture-of-Experts language models.

The model and language-model names load on first use (PEP 562), so tools that need only the config
and data layers (``zaya data prepare``'s worker processes) start without importing JAX."""

from typing import Any

from zaya_jax.config import Config, ConfigError, ModelConfig, load_config

__version__ = "0.1.0"

_LAZY = {
    "LanguageModel": "zaya_jax.lm",
    "load": "zaya_jax.lm",
    "Zaya": "zaya_jax.model",
    "param_counts": "zaya_jax.model",
}

__all__ = [
    "Config",
    "ConfigError",
    "LanguageModel",
    "ModelConfig",
    "Zaya",
    "__version__",
    "load",
    "load_config",
    "param_counts",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zaya_jax' has no attribute {name!r}")
