"""Typed, frozen configuration tree (its root :mod:`.schema`, the sections in :mod:`.model`,
:mod:`.data`, :mod:`.training`, :mod:`.post_training`, :mod:`.lora`, :mod:`.run` and :mod:`.mesh`) and how it is
loaded from YAML presets with inheritance and dotted overrides (:mod:`.loading`)."""

from zaya_jax.config.data import DataConfig, DataSource
from zaya_jax.config.errors import ConfigError
from zaya_jax.config.loading import (
    available_presets,
    config_dirs,
    config_from_dict,
    dump_config,
    load_config,
    model_config_from_dict,
    parse_override,
    save_config,
    to_dict,
)
from zaya_jax.config.lora import LORA_REFUSED, LORA_ROLES, LoraConfig
from zaya_jax.config.mesh import MESH_AXES, AxisRule, MeshConfig
from zaya_jax.config.model import EXECUTION_FIELDS, ModelConfig, RopeScaling
from zaya_jax.config.post_training import PreferenceConfig, RLConfig
from zaya_jax.config.run import (
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    ProfileConfig,
    ResilienceConfig,
    RunConfig,
    RuntimeConfig,
)
from zaya_jax.config.schema import Config
from zaya_jax.config.training import (
    NS_COEFFS,
    BalancingConfig,
    OptimConfig,
    RampPoint,
    Stage,
    StageRope,
    TrainConfig,
)

__all__ = [
    "EXECUTION_FIELDS",
    "LORA_REFUSED",
    "LORA_ROLES",
    "MESH_AXES",
    "NS_COEFFS",
    "AxisRule",
    "BalancingConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "EvalConfig",
    "LogConfig",
    "LoraConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "PreferenceConfig",
    "ProfileConfig",
    "RLConfig",
    "RampPoint",
    "ResilienceConfig",
    "RopeScaling",
    "RunConfig",
    "RuntimeConfig",
    "Stage",
    "StageRope",
    "TrainConfig",
    "available_presets",
    "config_dirs",
    "config_from_dict",
    "dump_config",
    "load_config",
    "model_config_from_dict",
    "parse_override",
    "save_config",
    "to_dict",
]
