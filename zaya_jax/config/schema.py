"""The typed, frozen configuration tree: its root, :class:`Config`, and the checks across its
sections. One dataclass per section, in a module per concern: :mod:`.model`, :mod:`.data`,
:mod:`.training` (train, optim, balancing), :mod:`.post_training` (preference, rl), :mod:`.run`
(run, log, eval, profile, checkpoint, runtime, resilience) and :mod:`.mesh`; each field's comment
is its documentation (``docs/CONFIG.md`` is generated from them), and each section's ``validate``
makes every impossible value or combination a :class:`ConfigError` naming the key and what to
change."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from zaya_jax.config.data import DataConfig
from zaya_jax.config.errors import ConfigError
from zaya_jax.config.lora import LoraConfig
from zaya_jax.config.mesh import MeshConfig
from zaya_jax.config.model import ModelConfig
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
from zaya_jax.config.training import BalancingConfig, OptimConfig, StageRope, TrainConfig


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run: ``run``, ``model``, ``train``, ``optim``, ``balancing``, ``preference``, ``rl``, ``lora``, ``data``,
    ``checkpoint``, ``log``, ``eval``, ``profile``, ``mesh``, ``runtime`` and ``resilience`` sections."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    balancing: BalancingConfig = dataclasses.field(default_factory=BalancingConfig)
    preference: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
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
        self.lora.validate()
        self.data.validate()
        if self.lora.enabled and not self.train.init_from:
            raise ConfigError(
                f"lora.rank={self.lora.rank} needs train.init_from (or --init-from): the base model the "
                "adapters are trained on (a run, step, HF or PEFT adapter directory)"
            )
        if self.lora.enabled and self.balancing.enabled:
            raise ConfigError(
                f"lora.rank={self.lora.rank} with balancing.enabled=true: the router's balancing biases are "
                "part of the frozen base (a PEFT adapter export carries none, so it would route differently "
                "from the run); set balancing.enabled=false"
            )
        if self.train.max_seq_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"train.seq_len={self.train.max_seq_len} exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings}; lower train.seq_len or raise the limit"
            )
        streams = self.data.streams
        for size in self.train.batch_sizes:
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

    def stage_model(self, stage: int) -> ModelConfig:
        """The model trained in curriculum ``stage``: ``model`` with the stage's RoPE
        (``train.stages[stage].rope``; the ``model`` section's when it sets none)."""
        rope = self.train.stages[stage].rope if self.train.stages else None
        if rope is None:
            return self.model
        return dataclasses.replace(
            self.model,
            rope_theta=rope.theta,
            rope_theta_sliding=rope.theta_sliding,
            rope_scaling=rope.scaling,
            rope_scaling_sliding=rope.scaling_sliding,
        )

    def at_stage(self, stage: int) -> Config:
        """This config as a checkpoint of curriculum ``stage`` records it: ``model`` is the model in
        force (:meth:`stage_model`: what ``zaya convert``, ``zaya eval``, ``zaya generate`` and
        ``train.init_from`` load), and every stage states its RoPE, so the curriculum reads the same."""
        if not self.train.stages:
            return self
        stages = tuple(
            dataclasses.replace(s, rope=s.rope or StageRope(
                self.model.rope_theta, self.model.rope_theta_sliding, self.model.rope_scaling,
                self.model.rope_scaling_sliding,
            ))
            for s in self.train.stages
        )  # fmt: skip
        train = dataclasses.replace(self.train, stages=stages)
        return dataclasses.replace(self, model=self.stage_model(stage), train=train)

    def validate_layout(self, sizes: Mapping[str, int]) -> None:
        """The parallel layout's divisibility rules for mesh axis ``sizes`` (-1 entries are skipped:
        they are checked again once the device count fills them); see :func:`check_layout`."""
        check_layout(self, sizes)


def check_layout(cfg: Config, sizes: Mapping[str, int]) -> None:
    """The parallel layout's divisibility rules for ``cfg`` on mesh axis ``sizes`` (-1 entries are
    skipped: they are checked again once the device count fills them)."""
    known = {axis: size for axis, size in sizes.items() if size > 0}
    if cfg.model.num_experts % known.get("expert", 1):
        raise ConfigError(
            f"model.num_experts={cfg.model.num_experts} is not divisible by mesh.expert={known['expert']}; "
            "choose an expert axis size that divides the number of experts"
        )
    shards = [axis for axis in ("data", "fsdp", "expert") if axis in known]
    split = math.prod(known[axis] for axis in shards)
    batch_sizes = set(cfg.train.batch_sizes)
    for size in sorted(batch_sizes):
        per_micro = size // cfg.train.micro_batches
        if per_micro % split:
            raise ConfigError(
                f"a micro-batch of {per_micro} sequences (batch {size} / train.micro_batches="
                f"{cfg.train.micro_batches}) is not divisible by {' x '.join(f'mesh.{a}' for a in shards)}"
                f" = {split}; make every batch size a multiple of {split * cfg.train.micro_batches}"
            )
    context = known.get("context", 1)
    chunks = 2 * context if context > 1 and cfg.mesh.context_layout == "zigzag" else context
    seq_lens = {cfg.train.seq_len, *(s.seq_len for s in cfg.train.stages)}
    for seq_len in sorted(seq_lens):
        if seq_len % chunks:
            layout = f" in {chunks} zig-zag chunks (mesh.context_layout=zigzag)" if chunks != context else ""
            raise ConfigError(
                f"sequence length {seq_len} is not divisible by mesh.context={context}{layout}; "
                f"use sequence lengths that are multiples of {chunks}"
                + (" or set mesh.context_layout=contiguous" if layout else "")
            )
