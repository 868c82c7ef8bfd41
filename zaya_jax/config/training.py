"""The sections of the training step: ``train`` (batch, sequence length, objective, the batch ramp
and curriculum stages), ``optim`` (Muon + AdamW, the learning-rate schedule) and ``balancing`` (the
router's bias controller)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from zaya_jax.config.errors import ConfigError
from zaya_jax.config.model import RopeScaling

# Keller Jordan's quintic Newton-Schulz coefficients (a, b, c): f(X) = a X + b (X X^T) X + c (X X^T)^2 X.
NS_COEFFS: tuple[float, float, float] = (3.4445, -4.775, 2.0315)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Muon for hidden weight matrices, AdamW for everything else, in one optax chain.

    Which leaves are Muon, and which of their axes form the matrix, is derived from the logical axis
    names (``zaya inspect --config NAME --optimizer``). Learning rates follow ``schedule``:
    ``wsd`` (linear warmup, constant, linear decay over the last ``decay_fraction`` of the steps),
    ``cosine`` (warmup, then cosine to ``min_lr_ratio``) or ``constant`` (warmup only).
    """

    muon_lr: float = 0.02  # peak learning rate of the Muon group
    adam_lr: float = 3e-3  # peak learning rate of the AdamW group
    muon_weight_decay: float = 0.0  # decoupled weight decay of Muon leaves
    adam_weight_decay: float = 0.1  # weight decay of AdamW matrices/tables (not norms, biases, scales)
    muon_momentum: float = 0.95  # Muon momentum
    nesterov: bool = True  # Nesterov momentum for Muon
    ns_steps: int = 5  # Newton-Schulz iterations per update
    ns_coeffs: tuple[float, ...] = NS_COEFFS  # quintic Newton-Schulz coefficients (a, b, c)
    # Moonlight's update-RMS matching: scale Muon updates by this * sqrt(max(A, B)); null = off.
    consistent_rms: float | None = None
    adam_b1: float = 0.9  # AdamW beta1
    adam_b2: float = 0.95  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # global gradient-norm clip (0: off)
    schedule: Literal["wsd", "cosine", "constant"] = "wsd"  # learning-rate shape: wsd, cosine or constant
    warmup_steps: int = 20  # linear warmup steps
    decay_fraction: float = 0.2  # wsd: fraction of the steps spent decaying
    min_lr_ratio: float = 0.0  # final learning rate / peak (cosine, wsd)
    # Learning rate under a batch-size ramp: unchanged, or scaled by (batch / final batch)^(1/2 or 1).
    lr_batch_scaling: Literal["none", "sqrt", "linear"] = "none"
    # The router's R x R MLP and down-projection are hidden matrices; "adamw" keeps them out of Muon.
    router_group: Literal["muon", "adamw"] = "muon"
    # "adamw": every hidden matrix trains with AdamW at adam_lr too (no Muon leaf), e.g. for RL steps,
    # whose noisy gradients Muon turns into full-size orthogonal updates.
    matrix_optimizer: Literal["muon", "adamw"] = "muon"
    # Newton-Schulz, into the kernel plan with model.kernels: "auto" (on a CPU each leaf's iteration as
    # one custom call where the kernels are built, on GPUs XLA's loop), "kernel" (the custom call on
    # every platform: on GPUs the fused zaya_newton_schulz, standard formulation only; refused where
    # not built) or "reference" (XLA's loop: no custom call).
    kernels: Literal["auto", "kernel", "reference"] = "auto"
    # Newton-Schulz's formulation (the XLA loop and the CPU call): "gram" iterates on the m x m Gram
    # matrix (fewer FLOPs when the long side is > 5/3 of the short one), "standard" on X; "auto": on a
    # CPU the one with fewer FLOPs (gram from a long side ~1.4x the short one); with XLA matmuls gram
    # when it is >= 4x on a wide matrix and float32 matmuls run at full precision (GPUs default to
    # TF32: ~1% off).
    ns_formulation: Literal["auto", "standard", "gram"] = "auto"

    def validate(self) -> None:
        for name in ("muon_lr", "adam_lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"optim.{name}={getattr(self, name)} must be > 0")
        if len(self.ns_coeffs) != 3:
            raise ConfigError(f"optim.ns_coeffs must hold 3 numbers (a, b, c), got {list(self.ns_coeffs)}")
        if self.ns_steps < 1:
            raise ConfigError(f"optim.ns_steps={self.ns_steps} must be >= 1")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"optim.muon_momentum={self.muon_momentum} must be in [0, 1)")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"optim.decay_fraction={self.decay_fraction} must be in [0, 1]")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")


@dataclasses.dataclass(frozen=True)
class BalancingConfig:
    """PID controller on the per-class load error that moves the router's balancing biases each step.

    Targets: ``skip_target`` of the tokens to the skip class, the rest uniform over the E experts.
    Velocity form, in units of the router-probability spread (see ``zaya_jax/model/balancing.py``):
    bias += spread * (kp * d(error) + ki * error + kd * d2(error)).
    """

    # Run the controller. false freezes the biases as the run starts with them (initialised, or
    # loaded by train.init_from): what post-training usually wants (the dpo and grpo presets set it).
    enabled: bool = True
    # Dimensionless gains, tuned on a router that sends ~70% of tokens to one of 8 experts:
    # max/min expert load 1.08 after 30 steps and 1.05 after 100, without oscillation.
    kp: float = 1.0
    ki: float = 1.0  # integral gain
    kd: float = 0.0  # derivative gain
    skip_target: float = 0.0  # fraction of tokens the skip class should take
    max_bias: float = 1.0  # biases stay within +-max_bias of their init

    def validate(self) -> None:
        if not 0.0 <= self.skip_target < 1.0:
            raise ConfigError(f"balancing.skip_target={self.skip_target} must be in [0, 1)")
        if min(self.kp, self.ki, self.kd) < 0:
            raise ConfigError("balancing.kp, ki and kd must be >= 0")
        if not self.max_bias > 0:
            raise ConfigError(f"balancing.max_bias={self.max_bias} must be > 0")


@dataclasses.dataclass(frozen=True)
class RampPoint:
    """From ``tokens`` tokens seen on, the global batch is ``batch_size`` sequences."""

    tokens: int  # tokens seen from which this batch size applies
    batch_size: int  # global batch in sequences


@dataclasses.dataclass(frozen=True)
class StageRope:
    """The RoPE of a curriculum stage, complete (what context extension changes): the bases of
    full-attention and sliding-window layers and their scaling (``model.rope_theta``, ``rope_theta_sliding``, ``rope_scaling``, ``rope_scaling_sliding``)."""

    theta: float  # RoPE base of full-attention layers in this stage (model.rope_theta)
    theta_sliding: float  # RoPE base of sliding-window layers (model.rope_theta_sliding)
    scaling: RopeScaling | None = None  # scaling of full-attention layers (null: none)
    scaling_sliding: RopeScaling | None = None  # scaling of sliding-window layers (null: none)

    def validate(self, key: str) -> None:
        for name in ("theta", "theta_sliding"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{key}.{name}={getattr(self, name)} must be > 0")
        for name in ("scaling", "scaling_sliding"):
            if getattr(self, name) is not None:
                getattr(self, name).validate(f"{key}.{name}")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One curriculum stage: ``tokens`` of training at ``seq_len`` with per-source ``mixture`` weights
    (one per ``data.sources`` entry; null keeps the sources' own weights), its own global batch
    (``batch_size``; null: the batch ramp's), the model's RoPE in this stage (``rope``; null: the ``model`` section's) and the learning rate's multiplier over
    the stage (``lr_scale``)."""

    tokens: int  # tokens trained in this stage
    seq_len: int  # row length in this stage
    mixture: tuple[float, ...] | None = None  # one weight per data source (null: the sources' weights)
    batch_size: int | None = None  # global batch in rows in this stage (null: train.batch_ramp's)
    # The RoPE in this stage, {theta, theta_sliding, scaling, scaling_sliding} (null: the model section's):
    # context extension raises the base or adds yarn/linear scaling; parameters and optimizer carry over.
    rope: StageRope | None = None
    # The learning rate's multiplier at the stage's first and last token, linear between (null: 1
    # throughout), on top of optim.schedule: [1.0, 0.1] anneals over the stage.
    lr_scale: tuple[float, float] | None = None

    def validate(self, key: str) -> None:
        if self.tokens < 1 or self.seq_len < 1 or (self.batch_size is not None and self.batch_size < 1):
            raise ConfigError(f"{key} needs positive tokens, seq_len and batch_size")
        if self.rope is not None:
            self.rope.validate(f"{key}.rope")
        if self.lr_scale is not None and (len(self.lr_scale) != 2 or min(self.lr_scale) < 0):
            raise ConfigError(
                f"{key}.lr_scale={list(self.lr_scale)} must be two multipliers >= 0: [at the stage's first "
                "token, at its last]"
            )

    def lr_multiplier(self, into: int) -> float:
        """The learning rate's multiplier ``into`` tokens after the stage began."""
        if self.lr_scale is None:
            return 1.0
        first, last = self.lr_scale
        return first + (last - first) * min(max(into / self.tokens, 0.0), 1.0)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop: ``batch_size`` is the global batch in sequences of ``seq_len`` tokens,
    split into ``micro_batches`` accumulated inside the step. ``batch_ramp`` and ``stages`` override
    batch size and sequence length/mixture as tokens are seen."""

    seed: int = 0  # parameter init and data order
    # What the step minimises: "lm" next-token loss on the trained tokens (pretraining; chat SFT
    # trains the assistant turns only); "dpo", "ipo" or "simpo" on preference pairs (the preference
    # section, sources of kind preference); "grpo" on sampled rollouts (the rl section); or the name
    # of an objective registered with zaya_jax.objectives.register (checked when the run starts).
    objective: str = "lm"
    # Start from existing weights: a run directory, a step directory (runs/x/checkpoints/N) or an HF
    # save_pretrained directory (converted on the fly). Parameters and balancing biases are loaded
    # into a fresh run (optimizer, step and data start fresh); on the command line the model config
    # is taken from the source ("" = initialise from train.seed).
    init_from: str = ""
    # train.init_from may name a quantized export (zaya convert --quantize, Zyphra's FP8/MXFP4
    # experts): true starts from its experts dequantized, false refuses it (its rounding would be
    # trained on as if it were the model's weights).
    init_dequantized: bool = False
    steps: int = 200  # optimizer steps in the run
    batch_size: int = 8  # global batch in sequences
    micro_batches: int = 1  # gradient accumulation inside the step (batch split into this many)
    seq_len: int = 128  # tokens per packed row
    z_loss: float = 0.0  # weight of the log-partition z-loss (0: off)
    # Sequence positions per chunk of the cross-entropy (the LM head is applied chunk by chunk, so
    # one chunk's float32 logits are rows per device x loss_chunk x vocab x 4 bytes); 0: automatic
    # (the largest multiple of 16 keeping one row's chunk under 2^24 logits: 48 at ZAYA1's vocabulary).
    loss_chunk: int = 0
    batch_ramp: tuple[RampPoint, ...] = ()  # batch-size schedule by tokens seen (see below)
    stages: tuple[Stage, ...] = ()  # curriculum stages: sequence length and mixture by tokens (see below)
    # Dispatch step t+1 before reading step t's outcome (loss, skipped flag, metrics), so the host's
    # work overlaps the device's; a rollback or stop decided from step t then acts one step later,
    # and the loss-spike limit leaves out the previous step's loss. Steps whose state a hook reads
    # (saves, evaluations, the profile's end, the last step) and every GRPO step are finished first.
    dispatch_ahead: bool = True

    def validate(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "micro_batches",
            "seq_len",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be a positive integer")
        if self.z_loss < 0:
            raise ConfigError(f"train.z_loss={self.z_loss} must be >= 0")
        if self.loss_chunk < 0:
            raise ConfigError(f"train.loss_chunk={self.loss_chunk} must be >= 0 (0: automatic)")
        for size in self.batch_sizes:
            if size % self.micro_batches:
                raise ConfigError(
                    f"batch size {size} is not divisible by train.micro_batches={self.micro_batches}; "
                    "use batch sizes that are multiples of it"
                )
        thresholds = [p.tokens for p in self.batch_ramp]
        if thresholds != sorted(thresholds) or len(set(thresholds)) != len(thresholds):
            raise ConfigError(f"train.batch_ramp token thresholds must increase strictly, got {thresholds}")
        for i, stage in enumerate(self.stages):
            stage.validate(f"train.stages[{i}]")

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Every global batch size the run may train at (``batch_size``, the ramp's, the stages')."""
        stages = (s.batch_size for s in self.stages if s.batch_size is not None)
        return tuple(dict.fromkeys((self.batch_size, *(p.batch_size for p in self.batch_ramp), *stages)))

    @property
    def max_seq_len(self) -> int:
        return max([self.seq_len, *(s.seq_len for s in self.stages)])

    def curriculum(self) -> tuple[Stage, ...]:
        """The stages as trained: ``stages``, or without any one stage of ``seq_len`` rows."""
        return self.stages or (Stage(tokens=1, seq_len=self.seq_len),)

    def stage_at(self, tokens_seen: int) -> tuple[int, int]:
        """(index, first token) of the stage the step after ``tokens_seen`` tokens trains in; the last
        stage goes on until ``steps``."""
        start = 0
        for index, stage in enumerate(self.stages[:-1]):
            if tokens_seen < start + stage.tokens:
                return index, start
            start += stage.tokens
        return max(len(self.stages) - 1, 0), start

    def spans(self) -> list[tuple[Stage, int, float]]:
        """(stage, first token, end) of every stage of :meth:`curriculum`; the last one never ends."""
        stages, start, out = self.curriculum(), 0, []
        for i, stage in enumerate(stages):
            end = math.inf if i == len(stages) - 1 else start + stage.tokens
            out.append((stage, start, end))
            start = end
        return out

    def history_change(self, before: TrainConfig, tokens_seen: int) -> str | None:
        """How this curriculum trains the first ``tokens_seen`` tokens (those a resumed run has
        trained) differently from ``before``'s, in words; None when it trains them the same way.
        Every stage begun keeps its fields and its start; one that ended keeps its end; the one in
        progress may end elsewhere after ``tokens_seen``, unless its learning rate changes along it."""
        ours = self.spans()
        for i, (old, start, end) in enumerate(before.spans()):
            if start >= tokens_seen:
                break
            key = f"train.stages[{i}]" if self.stages or before.stages else "train"
            if i >= len(ours):
                return f"{key} was removed"
            new, _, new_end = ours[i]
            for field in dataclasses.fields(Stage):
                was, now = getattr(old, field.name), getattr(new, field.name)
                if field.name != "tokens" and was != now:
                    return f"{key}.{field.name} changed from {was} to {now}"
            sloped = old.lr_scale is not None and old.lr_scale[0] != old.lr_scale[1]
            if (
                new_end < min(end, tokens_seen)
                or (end < tokens_seen and new_end != end)
                or (sloped and new.tokens != old.tokens)
            ):
                return f"{key}.tokens changed from {old.tokens} to {new.tokens}"
        return None
