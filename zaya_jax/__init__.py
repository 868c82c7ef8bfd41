"""zaya-jax: a JAX/XLA training stack for ZAYA1-style Mixture-of-Experts language models."""

from zaya_jax.config import Config, ConfigError, ModelConfig, load_config
from zaya_jax.lm import LanguageModel, load
from zaya_jax.model import Zaya, param_counts

__version__ = "0.1.0"

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
