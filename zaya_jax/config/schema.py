"""The typed, frozen configuration tree: its root, :class:`Config`, and the checks across its
sections. One dataclass per section, in a module per concern: :mod:`.model`, :mod:`.data`,
:mod:`.training` (train, optim, balancing), :mod:`.post_training` (preference, rl), :mod:`.run`
(run, log, eval, profile, checkpoint, runtime, resilience) and :mod:`.mesh`; each field's comment
is its documentation (``docs/CONFIG.md`` is generated from them), and each section's ``validate``
makes every impossible value or combination a :class:`ConfigError` naming the key and what to
change."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from zaya_jax.config.data import DataConfig
from zaya_jax.config.errors import ConfigError
from zaya_jax.config.mesh import MeshConfig, check_layout
from zaya_jax.config.model import ModelConfig
from zaya_jax.config.post_training import PREFERENCE_OBJECTIVES, PreferenceConfig, RLConfig
from zaya_jax.config.run import (
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    ProfileConfig,
    ResilienceConfig,
    RunConfig,
    RuntimeConfig,
)
from zaya_jax.config.training import BalancingConfig, OptimConfig, TrainConfig


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run: ``run``, ``model``, ``train``, ``optim``, ``balancing``, ``preference``, ``rl``, ``data``,
    ``checkpoint``, ``log``, ``eval``, ``profile``, ``mesh``, ``runtime`` and ``resilience`` sections."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    balancing: BalancingConfig = dataclasses.field(default_factory=BalancingConfig)
    preference: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    resilience: ResilienceConfig = dataclasses.field(default_factory=ResilienceConfig)

    def validate(self) -> None:
        self.run.validate()
        self.resilience.validate()
        self.checkpoint.validate()
        self.log.validate()
        self.eval.validate()
        self.profile.validate()
        self.mesh.validate()
        self.runtime.validate()
        self.model.validate()
        self.train.validate()
        self.optim.validate()
        self.balancing.validate()
        self.preference.validate()
        self.rl.validate()
        self.data.validate()
        self._validate_objective()
        if self.train.max_seq_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"train.seq_len={self.train.max_seq_len} exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings}; lower train.seq_len or raise the limit"
            )
        streams = self.data.streams
        for size in (self.train.batch_size, *(p.batch_size for p in self.train.batch_ramp)):
            if streams and size % streams:
                raise ConfigError(
                    f"batch size {size} is not divisible by data.streams={streams}; make every batch size a "
                    "multiple of it, or set data.streams to a divisor (0: automatic)"
                )
        for i, stage in enumerate(self.train.stages):
            if stage.mixture is not None and len(stage.mixture) != len(self.data.sources):
                raise ConfigError(
                    f"train.stages[{i}].mixture has {len(stage.mixture)} weights for "
                    f"{len(self.data.sources)} data.sources; give one weight per source"
                )
        self.validate_layout(self.mesh.sizes())

    def _validate_objective(self) -> None:
        """The data an objective trains on: preference pairs for dpo/ipo/simpo, and only for them."""
        pairs = [s.name for s in self.data.sources if s.kind == "preference"]
        others = [s.name for s in self.data.sources if s.kind != "preference"]
        objective = self.train.objective
        if objective in PREFERENCE_OBJECTIVES and others:
            raise ConfigError(
                f"train.objective={objective} trains on preference pairs, but data.sources {others} are not "
                "of kind preference; give only {kind: preference, path: PAIRS.jsonl} sources"
            )
        if objective not in PREFERENCE_OBJECTIVES and pairs:
            raise ConfigError(
                f"data.sources {pairs} hold preference pairs, which train.objective={objective} cannot use; "
                "set train.objective to dpo, ipo or simpo"
            )
        if objective == "grpo":
            rl, train = self.rl, self.train
            if (rl.steps_per_rollout * train.batch_size) % rl.group_size and not rl.rollouts:
                raise ConfigError(
                    f"a rollout of rl.steps_per_rollout x train.batch_size = {rl.steps_per_rollout * train.batch_size} "
                    f"sequences is not a whole number of groups of rl.group_size={rl.group_size}; make it a multiple"
                )
            if train.stages or train.batch_ramp:
                raise ConfigError(
                    "train.objective=grpo takes a fixed batch: remove train.stages and train.batch_ramp"
                )

    def validate_layout(self, sizes: Mapping[str, int]) -> None:
        """The parallel layout's divisibility rules for mesh axis ``sizes`` (-1 entries are skipped:
        they are checked again once the device count fills them); see :func:`.mesh.check_layout`."""
        check_layout(self, sizes)
