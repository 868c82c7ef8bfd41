"""The typed, frozen configuration tree: one dataclass per section, each field's comment its
documentation (``docs/CONFIG.md`` is generated from them), and each section's ``validate``: every
impossible value or combination is a :class:`ConfigError` naming the key and what to change."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Literal


class ConfigError(ValueError):
    """A configuration value, key or combination that cannot work; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where a run lives: ``dir`` defaults to ``runs/<name>``."""

    name: str = "zaya"  # run directory name under runs/ (a plain name, no '/')
    dir: str | None = None  # explicit run directory (overrides runs/<name>)

    @property
    def path(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name

    def validate(self) -> None:
        # The name becomes a directory under runs/: it must not climb out of it or nest.
        if (
            not self.name
            or self.name in (".", "..")
            or "/" in self.name
            or "\\" in self.name
            or "\0" in self.name
        ):
            raise ConfigError(
                f"run.name={self.name!r} must be a plain directory name (no '/', not '.' or '..'); "
                "use run.dir to place a run elsewhere"
            )


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """The metrics record (the ``Logging`` hook): written to ``metrics.jsonl`` every ``every`` steps
    and at every evaluated step, and to the ``trackers`` beside it."""

    every: int = 10  # steps between metrics records
    # Where metrics go besides metrics.jsonl (always written): "tensorboard" (tb/), "wandb" and
    # "trackio" (their extras; process 0 only; WANDB_MODE=offline / trackio's local store work
    # without a network).
    trackers: tuple[str, ...] = ("tensorboard",)
    project: str = "zaya-jax"  # the wandb / trackio project

    def validate(self) -> None:
        if self.every < 1:
            raise ConfigError(f"log.every={self.every} must be a positive integer")
        unknown = sorted(set(self.trackers) - {"tensorboard", "wandb", "trackio"})
        if unknown:
            raise ConfigError(f"log.trackers names {unknown}; use any of tensorboard, wandb, trackio")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The held-out loss during training (the ``Evaluation`` hook): ``batches`` batches of
    ``train.batch_size`` x ``train.seq_len`` tokens of the held-out split, every ``every`` steps and
    after the final step."""

    every: int = 100  # steps between held-out evaluations
    batches: int = 4  # held-out batches per evaluation

    def validate(self) -> None:
        for name in ("every", "batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"eval.{name}={getattr(self, name)} must be a positive integer")


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A ``jax.profiler`` trace (the ``Profiling`` hook) of the steps [first, last] into
    ``<run>/profile/``."""

    steps: tuple[int, ...] = ()  # [first, last] (empty: no trace)

    def validate(self) -> None:
        if self.steps and (len(self.steps) != 2 or not 1 <= self.steps[0] <= self.steps[1]):
            raise ConfigError(
                f"profile.steps={list(self.steps)} must be [first, last] with 1 <= first <= last"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """ZAYA1 architecture (spec §1.1). Defaults are the Hugging Face ``ZayaConfig`` defaults (ZAYA1-8B).

    Names follow the HF fields except ``num_layers`` (HF ``num_hidden_layers``), ``num_heads``
    (HF ``num_attention_heads``: query heads in the compressed latent) and the RoPE fields, which
    flatten HF's per-layer-type ``rope_parameters``.
    """

    vocab_size: int = 262272  # token ids (embedding rows; tied LM head)
    hidden_size: int = 2048  # residual width H
    num_layers: int = 40  # decoder blocks (HF num_hidden_layers)
    num_heads: int = 8  # query heads in the CCA latent
    num_kv_heads: int = 2  # key/value heads (GQA groups = num_heads / num_kv_heads)
    head_dim: int = 128  # width per head d
    cca_time0: int = 2  # taps of CCA's first (depthwise) q/k convolution
    cca_time1: int = 2  # taps of CCA's second (grouped) q/k convolution
    attention_bias: bool = False  # biases on the q/k/v/o projections
    rope_theta: float = 5_000_000.0  # RoPE base of full-attention ('hybrid') layers
    rope_theta_sliding: float = 10_000.0  # RoPE base of sliding-window layers
    partial_rotary_factor: float = 0.5  # fraction of head_dim that is rotated
    # Per layer 'hybrid' or 'hybrid_sliding' (null: all 'hybrid').
    layer_types: tuple[Literal["hybrid", "hybrid_sliding"], ...] | None = None
    sliding_window: int | None = None  # keys a sliding layer sees, the current token included
    max_position_embeddings: int = 131072  # longest sequence (train.seq_len and stages must fit)
    num_experts: int = 16  # routed experts E (the skip class is extra)
    num_experts_per_tok: int = 1  # must be 1 (top-1 over E + 1 classes)
    moe_intermediate_size: int = 2048  # SwiGLU width I of each expert
    router_hidden_size: int = 256  # router state width R (down-projection, EDA, MLP)
    hidden_act: Literal["silu", "gelu", "relu"] = "silu"  # expert activation (SwiGLU gate)
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    initializer_range: float = 0.02  # std of the normal weight init
    tie_word_embeddings: bool = True  # LM head = embedding table transposed
    lm_head_bias: bool = False  # bias on the LM head
    pad_token_id: int = 0  # padding id (embedding row kept at 0)
    bos_token_id: int = 2  # beginning-of-sequence id
    eos_token_id: int = 106  # end-of-sequence id (default stop token)
    # Every id that ends a generated sequence, kept whole from an HF eos_token_id list (e.g. a
    # tokenizer's </s> and Gemma-3's <end_of_turn>, 106); empty: eos_token_id alone.
    eos_token_ids: tuple[int, ...] = ()
    # What a token routed to the MOD skip class receives from the MoE (spec §7 Q1):
    # "zero" (HF >= 5.13, ZAYA1-8B) or "scaled_input" (p_skip * normed input; legacy fork, SGLang).
    mod_skip_output: Literal["zero", "scaled_input"] = "zero"
    # MoE compute: "auto" (the fastest dropless path on the live device, measured once per device
    # kind and shapes and cached), "sorted" (grouped matmul), "dense" (every expert on every token)
    # or "capacity" (capacity_factor slots per expert per sequence; drops the overflow).
    moe_impl: Literal["dense", "sorted", "capacity", "auto"] = "auto"
    capacity_factor: float = 1.25  # slots per expert = factor x tokens / E (moe_impl=capacity)
    # Attention kernel: "auto" (the fused CPU custom call for a one-device CPU program where it is
    # built, else blocked), "blocked" (flash-style, memory linear in the sequence, recomputing
    # backward), "dense" (the definition: (seq, seq) scores; a reference for tests), "pallas" (the
    # fused Pallas/Triton GPU kernel, every mask; interpret mode on CPU, slow), "cpu" (the fused
    # CPU custom call, every mask; blocked on other devices or without the built library) or
    # "cudnn" (jax.nn.dot_product_attention: causal only, no packed documents, padding or window).
    attention_impl: Literal["auto", "blocked", "dense", "pallas", "cudnn", "cpu"] = "auto"
    # Key block length of the blocked kernel (a sequence attending to itself is cut into a power
    # of two of blocks of about this length). 128 was fastest on CPU (bench/attention.py).
    attention_block: int = 128
    # Activation rematerialisation per block in training: "none" keeps every activation, "minimal"
    # keeps the weight-matmul outputs and recomputes the rest, "full" keeps only each block's input.
    remat: Literal["none", "minimal", "full"] = "none"
    # Layers per iteration of the scan over blocks: 1 keeps one compiled block (compile time and
    # program size independent of depth); num_layers unrolls the loop, which lets XLA skip stacking
    # each layer's saved activations (faster on CPU and for shallow models; slower to compile).
    scan_unroll: int = 1
    # The attention merge + MoE input norm: "reference" (Flax/XLA) or "custom" (the fused
    # zaya_residual_rms_norm custom call where registered for the platform, else the reference).
    kernels: Literal["reference", "custom"] = "reference"
    # Mixed precision: parameters are stored in param_dtype, matmuls run in dtype; the residual
    # stream is always float32 (spec §2.1).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Storage dtype of the parameters (and of the Muon/AdamW moments).
    param_dtype: Literal["float32", "bfloat16"] = "float32"

    # ---- derived sizes (spec §2.3 notation) ----
    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """C = (nq + nk) * d, the channels of the two-stage q/k convolution."""
        return self.q_width + self.kv_width

    @property
    def conv_context(self) -> int:
        """P = (k0 - 1) + (k1 - 1), raw q/k columns a token's convolution reads from the past."""
        return self.cca_time0 - 1 + self.cca_time1 - 1

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        return self.layer_types if self.layer_types is not None else ("hybrid",) * self.num_layers

    @property
    def has_sliding_layers(self) -> bool:
        return "hybrid_sliding" in self.resolved_layer_types

    def validate(self) -> None:
        positive = [
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "cca_time0",
            "cca_time1",
            "max_position_embeddings",
            "num_experts",
            "moe_intermediate_size",
            "router_hidden_size",
            "scan_unroll",
            "attention_block",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be a positive integer")
        for name in ("rope_theta", "rope_theta_sliding", "rms_norm_eps", "capacity_factor"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be > 0")
        if self.num_experts_per_tok != 1:
            raise ConfigError(
                f"model.num_experts_per_tok={self.num_experts_per_tok}: ZAYA1 routes each token to exactly "
                "one expert (the router scores E+1 classes incl. the skip); set model.num_experts_per_tok=1"
            )
        if self.num_heads % self.num_kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} does not divide model.num_heads={self.num_heads}; "
                f"use one of {divisors}"
            )
        if self.kv_width % 2:
            raise ConfigError(
                f"model.num_kv_heads * model.head_dim = {self.kv_width} must be even: the value is split into "
                "a current-token half and a previous-token half; use an even model.head_dim"
            )
        if not 0.0 <= self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ConfigError(
                f"model.partial_rotary_factor={self.partial_rotary_factor} gives a rotary width of "
                f"{self.rotary_dim} of head_dim={self.head_dim}; choose a factor in [0, 1] giving an even width"
            )
        types_ = self.resolved_layer_types
        if len(types_) != self.num_layers:
            raise ConfigError(
                f"model.layer_types has {len(types_)} entries but model.num_layers={self.num_layers}; "
                "give one type per layer or set model.layer_types=null (all 'hybrid')"
            )
        if "hybrid_sliding" in types_ and self.sliding_window is None:
            raise ConfigError(
                "model.layer_types contains 'hybrid_sliding' but model.sliding_window is null; "
                "set model.sliding_window (the span including the current token, e.g. 4097)"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"model.sliding_window={self.sliding_window} must be >= 1 (or null)")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"model.{name}={value} must be in [0, model.vocab_size={self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ConfigError(
                f"model.eos_token_ids={list(self.eos_token_ids)} must be in [0, {self.vocab_size})"
            )

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids generation stops on by default: ``eos_token_id`` and every id of ``eos_token_ids``."""
        return tuple(dict.fromkeys((self.eos_token_id, *self.eos_token_ids)))

    def capacity(self, tokens_per_group: int) -> int:
        """Per-expert slots of the capacity path for a group of ``tokens_per_group`` tokens."""
        return max(1, math.ceil(self.capacity_factor * tokens_per_group / self.num_experts))


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One input of the data mixture.

    ``kind``: ``stdlib`` (the built-in corpus: the running interpreter's standard-library source;
    ``path`` unused), ``text`` (a file, directory or glob of UTF-8 text files, one document per
    file), ``jsonl`` (one document per line, field ``text_field``), ``parquet`` (column
    ``text_field``), ``chat`` (JSONL conversations, one ``{"messages": [...]}`` per line, rendered
    with the tokenizer's chat template and trained on the assistant turns only; see
    :mod:`zaya_jax.data.chat`), ``preference`` (JSONL pairs ``{"prompt" or "messages", "chosen",
    "rejected"}`` for ``train.objective`` dpo, ipo or simpo; see :mod:`zaya_jax.data.preference`) or
    ``arrayrecord`` (a directory written by ``zaya data prepare``).
    """

    name: str = "stdlib"  # unique name (events, mixture order)
    # stdlib, text, jsonl, parquet, chat, preference or arrayrecord (see above).
    kind: Literal["stdlib", "text", "jsonl", "parquet", "chat", "preference", "arrayrecord"] = "stdlib"
    path: str | None = None  # file, directory or glob (unused for stdlib)
    weight: float = 1.0  # sampling weight in the mixture
    text_field: str = "text"  # JSONL field / Parquet column holding the text
    # chat, preference: a Jinja chat-template file; unset: the tokenizer's own (chat_template.jinja beside
    # tokenizer.json, or tokenizer_config.json's chat_template; the byte tokenizer's built-in one).
    chat_template: str | None = None


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it becomes token rows."""

    sources: tuple[DataSource, ...] = (DataSource(),)  # the inputs of the mixture (see below)
    # "byte" (no download; ids 0/1/2 = pad/eos/bos, byte b -> b + 3) or a path to an HF tokenizer.json.
    tokenizer: str = "byte"
    held_out_fraction: float = 0.02  # documents held out for evaluation (by hashed key)
    # "error": an unreadable or undecodable document stops the run naming the file; "skip": counted.
    on_bad_document: Literal["error", "skip"] = "error"
    prefetch: int = 2  # batches prepared ahead of the step on a background thread
    # Training rows are shuffled within windows of this many packed rows (Grain's window shuffle),
    # so a batch mixes many documents instead of consecutive pieces of one; 0 or 1: packing order.
    shuffle_window: int = 4096
    # Every batch is read from this many row streams (documents k::streams), so a run resumes on any
    # number of processes with the same rows; 0: the largest power of two <= 8 dividing every batch
    # size (zaya_jax/data/streams.py). Set it to a multiple of the process counts you launch on.
    streams: int = 0

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError(
                "data.sources is empty; list at least one source (e.g. {name: stdlib, kind: stdlib})"
            )
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"data.sources names must be unique, got {names}")
        for i, source in enumerate(self.sources):
            if source.kind != "stdlib" and not source.path:
                raise ConfigError(f"data.sources[{i}] ({source.name}) of kind {source.kind!r} needs a path")
            if not source.weight > 0:
                raise ConfigError(f"data.sources[{i}].weight={source.weight} must be > 0")
            if source.chat_template and source.kind not in ("chat", "preference"):
                raise ConfigError(
                    f"data.sources[{i}] ({source.name}) sets chat_template but is of kind {source.kind!r}; "
                    "chat templates apply to kinds chat and preference (a prepared chat directory names its own)"
                )
        if not 0.0 < self.held_out_fraction < 0.5:
            raise ConfigError(f"data.held_out_fraction={self.held_out_fraction} must be in (0, 0.5)")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch} must be >= 0")
        if self.shuffle_window < 0:
            raise ConfigError(f"data.shuffle_window={self.shuffle_window} must be >= 0 (0: no row shuffle)")
        if self.streams < 0:
            raise ConfigError(f"data.streams={self.streams} must be >= 0 (0: automatic)")


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
    # Newton-Schulz: "reference" (XLA matmuls) or "custom" (the zaya_newton_schulz custom call
    # where its library is registered for the platform, else the reference).
    kernels: Literal["reference", "custom"] = "reference"

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
class Stage:
    """One curriculum stage: ``tokens`` of training at ``seq_len`` with per-source ``mixture`` weights
    (one per ``data.sources`` entry; null keeps the sources' own weights)."""

    tokens: int  # tokens trained in this stage
    seq_len: int  # row length in this stage
    mixture: tuple[float, ...] | None = None  # one weight per data source (null: the sources' weights)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop: ``batch_size`` is the global batch in sequences of ``seq_len`` tokens,
    split into ``micro_batches`` accumulated inside the step. ``batch_ramp`` and ``stages`` override
    batch size and sequence length/mixture as tokens are seen."""

    seed: int = 0  # parameter init and data order
    # What the step minimises: "lm" next-token loss on the trained tokens (pretraining; chat SFT
    # trains the assistant turns only); "dpo", "ipo" or "simpo" on preference pairs (the preference
    # section, sources of kind preference); "grpo" on sampled rollouts (the rl section).
    objective: Literal["lm", "dpo", "ipo", "simpo", "grpo"] = "lm"
    # Start from existing weights: a run directory, a step directory (runs/x/checkpoints/N) or an HF
    # save_pretrained directory (converted on the fly). Parameters and balancing biases are loaded
    # into a fresh run (optimizer, step and data start fresh); on the command line the model config
    # is taken from the source ("" = initialise from train.seed).
    init_from: str = ""
    steps: int = 200  # optimizer steps in the run
    batch_size: int = 8  # global batch in sequences
    micro_batches: int = 1  # gradient accumulation inside the step (batch split into this many)
    seq_len: int = 128  # tokens per packed row
    z_loss: float = 0.0  # weight of the log-partition z-loss (0: off)
    # Sequence positions per chunk of the cross-entropy (the LM head is applied chunk by chunk, so
    # one chunk's float32 logits are rows per device x loss_chunk x vocab x 4 bytes); 0: automatic
    # (the largest multiple of 16 keeping one row's chunk under 2^25 logits: 112 at ZAYA1's vocabulary).
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
        sizes = [self.batch_size, *(p.batch_size for p in self.batch_ramp)]
        for size in sizes:
            if size % self.micro_batches:
                raise ConfigError(
                    f"batch size {size} is not divisible by train.micro_batches={self.micro_batches}; "
                    "use batch sizes that are multiples of it"
                )
        thresholds = [p.tokens for p in self.batch_ramp]
        if thresholds != sorted(thresholds) or len(set(thresholds)) != len(thresholds):
            raise ConfigError(f"train.batch_ramp token thresholds must increase strictly, got {thresholds}")
        for i, stage in enumerate(self.stages):
            if stage.tokens < 1 or stage.seq_len < 1:
                raise ConfigError(f"train.stages[{i}] needs positive tokens and seq_len")

    @property
    def max_seq_len(self) -> int:
        return max([self.seq_len, *(s.seq_len for s in self.stages)])


PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning (``train.objective`` dpo, ipo or simpo) on pairs of a chosen and a rejected
    completion of one prompt. With h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log
    ref(rejected)), summed over each completion's tokens: dpo minimises -log sigmoid(beta h), ipo
    (h - 1 / (2 beta))^2; simpo uses no reference and the completions' mean log-probabilities:
    -log sigmoid(beta (mean log pi(chosen) - mean log pi(rejected)) - simpo_gamma). The reference
    log-probabilities come from the starting weights, computed once before step 1 and stored in
    the run directory (``reference/``); see :mod:`zaya_jax.objectives.reference`."""

    beta: float = 0.1  # inverse temperature of the implicit reward (SimPO papers use 2.0-2.5)
    simpo_gamma: float = 0.5  # simpo: the target margin between chosen and rejected rewards

    def validate(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"preference.beta={self.beta} must be > 0")
        if self.simpo_gamma < 0:
            raise ConfigError(f"preference.simpo_gamma={self.simpo_gamma} must be >= 0")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Reinforcement learning with GRPO (``train.objective: grpo``; :mod:`zaya_jax.objectives.rollouts`).

    Every ``steps_per_rollout`` steps the current policy samples ``group_size`` completions of each of
    ``steps_per_rollout * train.batch_size / group_size`` prompts with zaya's own sampler and decode
    cache, capturing each token's log-probability and the class every layer's router chose; the
    reward function scores them, and each completion's advantage is its reward minus its group's
    mean, over the group's standard deviation. The step then minimises the clipped surrogate
    -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) per completion token, r = pi / pi_sampler, plus
    ``kl`` times the k3 estimate of KL(pi || reference), averaged over completion tokens; with
    ``replay_routes`` every layer selects the class the sampler chose (router replay). One sequence
    per row: ``train.seq_len`` must hold the longest prompt plus ``max_new_tokens``."""

    # The prompts: "reverse" (the built-in reverse-a-word task, zaya_jax.data.tasks) or a JSONL file of
    # chat records ({"messages": [...]}, more fields allowed); a final assistant message is left out
    # of the prompt (the reward function still sees the whole record).
    prompts: str = "reverse"
    # The reward: "module:function" called as function(record, completion_text) -> float.
    reward: str = "zaya_jax.data.tasks:reverse_reward"
    # Rollouts read from JSONL files (a file, directory or glob) instead of sampled (see
    # zaya_jax.objectives.rollouts for the record format; routes captured by another engine replay here).
    rollouts: str = ""
    group_size: int = 8  # completions sampled per prompt (the group of the advantage)
    max_new_tokens: int = 32  # longest completion
    temperature: float = 1.0  # sampling temperature (log-probabilities are at temperature 1 either way)
    steps_per_rollout: int = 1  # optimizer steps on each rollout (> 1: later steps train off-policy)
    replay_routes: bool = True  # force the sampler's routes in the training forward
    clip_low: float = 0.2  # the ratio's lower clip 1 - clip_low
    clip_high: float = 0.2  # the ratio's upper clip 1 + clip_high (DAPO's clip-higher: 0.28)
    # Weight of KL(pi || reference) per token (0: off). > 0 keeps a copy of the starting weights on
    # the device to score every rollout.
    kl: float = 0.0
    eval_prompts: int = 64  # held-out prompts whose mean greedy reward is eval_reward
    prompt_seed: int = 0  # seed of the built-in task's prompts (held-out ones come from seed + 1)

    def validate(self) -> None:
        for name in ("group_size", "max_new_tokens", "steps_per_rollout", "eval_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rl.{name}={getattr(self, name)} must be a positive integer")
        if self.group_size < 2 and not self.rollouts:
            raise ConfigError(
                f"rl.group_size={self.group_size}: a group needs >= 2 completions for an advantage"
            )
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ConfigError("rl.clip_low must be in [0, 1) and rl.clip_high >= 0")
        if self.kl < 0 or self.temperature <= 0:
            raise ConfigError("rl.kl must be >= 0 and rl.temperature > 0")
        if ":" not in self.reward:
            raise ConfigError(f"rl.reward={self.reward!r} must be 'module:function'")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Training checkpoints in ``<run>/checkpoints/<step>/``: every ``every_steps`` steps and/or every
    ``every_minutes`` minutes (0: off; the final step is always saved), keeping the last ``keep``
    plus every ``keep_every``-th step (0: none) plus the ``keep_best`` steps of lowest held-out loss.
    Every decision is agreed by all processes (``zaya_jax.train.consensus``)."""

    every_steps: int = 0  # save every N steps (0: off)
    every_minutes: float = 0.0  # save every N minutes (0: off), by the clock of any process
    keep: int = 3  # most recent checkpoints kept
    keep_every: int = 0  # also keep every N-th step forever (0: none)
    # Also keep the N checkpoints of lowest held-out loss (0: off); every evaluated step is saved.
    keep_best: int = 0
    async_save: bool = True  # write in the background while training continues
    # Check every restored array against the fingerprint recorded when it was saved (a checkpoint
    # that fails is quarantined and the previous one used). Evaluation and export always verify.
    verify: bool = True

    def validate(self) -> None:
        for name in ("every_steps", "keep_every", "every_minutes", "keep_best"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint.{name}={getattr(self, name)} must be >= 0")
        if self.keep < 1:
            raise ConfigError(
                f"checkpoint.keep={self.keep} must be >= 1 (the latest checkpoint is always kept)"
            )


MESH_AXES = ("data", "fsdp", "expert", "context")


@dataclasses.dataclass(frozen=True)
class AxisRule:
    """Logical axis ``name`` is split over the mesh axes ``mesh`` (empty: replicated)."""

    name: str  # logical axis (embed, experts, vocab, ...)
    mesh: tuple[str, ...] = ()  # mesh axes it is split over (empty: replicated)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh: sizes of the ``data``, ``fsdp``, ``expert`` and ``context`` axes, one of
    which may be -1 (all devices left over). The global batch is split over data x fsdp x expert,
    the sequence over context, expert weights over expert and the residual width of every weight
    (and its optimizer state) over fsdp; with ``optimizer_sharding: zero1`` the optimizer state is
    also split over data. ``rules`` override entries of the logical-axis table
    (``zaya_jax.parallel.rules.DEFAULT_RULES``)."""

    data: int = -1  # data-parallel replicas (-1: the devices left over)
    fsdp: int = 1  # parameter/optimizer sharding over the residual width
    expert: int = 1  # expert-parallel groups (divides num_experts)
    context: int = 1  # sequence split (ring attention, CCA halos)
    # How a sequence is split over the context axis: "zigzag" (2 x context chunks, device i holding
    # chunks i and 2 x context - 1 - i: every device does the same causal attention work; needs
    # sequence lengths divisible by 2 x context) or "contiguous" (device i holds the i-th part).
    context_layout: Literal["zigzag", "contiguous"] = "zigzag"
    # Expert parallelism: rows exchanged per device pair = factor x local tokens / |expert|;
    # 0 = all local tokens (dropless). Tokens beyond it are dropped and counted.
    expert_capacity_factor: float = 0.0
    # How tokens travel to their experts: "padded" all_to_all (every platform), "ragged"
    # (jax.lax.ragged_all_to_all, only routed rows; GPU/TPU) or "auto" (ragged unless on CPU).
    expert_exchange: Literal["auto", "padded", "ragged"] = "auto"
    # Where the optimizer state lives: "none" (like its parameter) or "zero1" (ZeRO-1, ZAYA1's
    # layout: also split over the data axis; gradients reduce-scattered, the update computed on each
    # device's share, the new parameters all-gathered once per step).
    optimizer_sharding: Literal["none", "zero1"] = "none"
    rules: tuple[AxisRule, ...] = ()  # overrides of the logical-axis table (see below)

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def validate(self) -> None:
        sizes = self.sizes()
        auto = [axis for axis, size in sizes.items() if size == -1]
        if len(auto) > 1:
            raise ConfigError(f"mesh axes {auto} are all -1; at most one axis may be auto-filled")
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise ConfigError(f"mesh.{axis}={size} must be a positive size or -1 (auto)")
        if self.expert_capacity_factor < 0:
            raise ConfigError(
                f"mesh.expert_capacity_factor={self.expert_capacity_factor} must be >= 0 (0 = dropless)"
            )
        for rule in self.rules:
            unknown = [a for a in rule.mesh if a not in MESH_AXES]
            if unknown:
                raise ConfigError(
                    f"mesh.rules entry {rule.name!r} names unknown mesh axes {unknown}; use {MESH_AXES}"
                )


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Backend and collective settings, applied before JAX starts its backends and recorded in the
    run's ``events.jsonl`` start event. Combine thresholds (0 = XLA's default) set how many bytes of
    small all-reduces / all-gathers / reduce-scatters XLA fuses into one collective on GPUs;
    ``xla_flags`` are appended to ``XLA_FLAGS`` as given. The timeouts govern the multi-process
    runtime: start-up, heartbeat (a silent process is declared dead after it) and barriers."""

    all_reduce_combine_threshold_bytes: int = 0  # XLA GPU all-reduce combining (0: XLA default)
    all_gather_combine_threshold_bytes: int = 0  # XLA GPU all-gather combining (0: XLA default)
    reduce_scatter_combine_threshold_bytes: int = 0  # XLA GPU reduce-scatter combining (0: XLA default)
    xla_flags: tuple[str, ...] = ()  # appended to XLA_FLAGS as given (--xla_NAME=VALUE)
    # Persistent XLA compilation cache, shared by train, eval, generate and supervised restarts:
    # "auto" = $ZAYA_CACHE_DIR/xla, else $XDG_CACHE_HOME/zaya-jax/xla (~/.cache/zaya-jax/xla); a path;
    # or "" (off). Programs that compile in under a second are not cached.
    compilation_cache_dir: str = "auto"
    init_timeout_s: int = 300  # multi-process start-up timeout
    heartbeat_timeout_s: int = 100  # a silent process is declared dead after this
    barrier_timeout_s: float = 3600.0  # limit of the trainer's barriers
    # Before the first step, compare the compiled step's planned peak with the device's memory and
    # stop with settings that fit when it is larger (zaya_jax.train.fit).
    check_fit: bool = True
    memory_limit_gb: float = 0.0  # per device, for that check (0: the device's, or the host's RAM on CPU)

    def validate(self) -> None:
        for name in ("all_reduce", "all_gather", "reduce_scatter"):
            value = getattr(self, f"{name}_combine_threshold_bytes")
            if value < 0:
                raise ConfigError(
                    f"runtime.{name}_combine_threshold_bytes={value} must be >= 0 (0 = XLA default)"
                )
        if self.memory_limit_gb < 0:
            raise ConfigError(
                f"runtime.memory_limit_gb={self.memory_limit_gb} must be >= 0 (0 = the device's)"
            )
        for name in ("init_timeout_s", "heartbeat_timeout_s", "barrier_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"runtime.{name}={getattr(self, name)} must be > 0 seconds")
        for flag in self.xla_flags:
            if not flag.startswith("--xla_"):
                raise ConfigError(f"runtime.xla_flags entry {flag!r} must look like --xla_NAME=VALUE")

    def flags(self) -> list[str]:
        """The XLA flags this section adds."""
        out = [
            f"--xla_gpu_{name}_combine_threshold_bytes={getattr(self, f'{name}_combine_threshold_bytes')}"
            for name in ("all_reduce", "all_gather", "reduce_scatter")
            if getattr(self, f"{name}_combine_threshold_bytes")
        ]
        return [*out, *self.xla_flags]


@dataclasses.dataclass(frozen=True)
class ResilienceConfig:
    """What the trainer does when a step goes wrong or stops making progress."""

    # No step finished for this long (compilation included) -> dump every thread's stack to
    # <run>/hang_stacks.txt and exit with code 75 (a supervisor restarts it). 0: no watchdog.
    hang_timeout_s: float = 1800.0
    # The same limit while compiling, restoring, saving or starting (phases that legitimately
    # take long on big models).
    compile_timeout_s: float = 3600.0
    # A non-finite loss or gradient norm: "skip" the update, "rollback" to the last checkpoint and
    # skip the data since then, or "stop" the run (exit 1).
    on_nonfinite: Literal["skip", "rollback", "stop"] = "skip"
    # A loss spike (robust z-score of the loss against the last spike_window accepted steps above
    # spike_zscore): "none" (off), "skip" or "rollback", as above.
    on_spike: Literal["none", "skip", "rollback"] = "none"
    spike_zscore: float = 6.0  # robust z-score above which a loss is a spike
    spike_window: int = 100  # accepted losses the spike limit is computed from
    spike_warmup: int = 20  # accepted steps before spikes are judged
    # More rollbacks than this in one run stop it (the data, not one bad batch, is at fault).
    max_rollbacks: int = 5
    # Routing health (zaya_jax.resilience.routing), judged per layer on means over the last
    # routing_window steps: an expert load collapse, the skip fraction drifting from
    # balancing.skip_target, a balancing bias pinned at its clamp, router entropy collapse.
    # "warn" (a routing_alarm event and a line), "rollback" to the last checkpoint, "stop" (exit 1),
    # "none", or "skip": each step checks its own statistics (not windowed; no pinned-bias check) and
    # keeps the previous state when a layer is past a limit (a skip event, reason routing), the
    # windowed alarm reported as with warn.
    on_routing_alarm: Literal["none", "warn", "skip", "rollback", "stop"] = "warn"
    routing_window: int = 50  # steps the routing statistics are averaged over (and first judged after)
    # Steps of the run before routing is first judged: a fresh router takes a few hundred steps to
    # balance (tiny: an expert idle for 50 steps around step 100, max/min share <= 8.3 after step 300).
    routing_warmup: int = 300
    routing_max_load_ratio: float = 50.0  # max / min expert share of a layer's tokens (inf: an idle expert)
    routing_max_skip_drift: float = 0.5  # |skip share - balancing.skip_target|
    routing_min_entropy: float = 0.02  # router entropy / ln(E + 1), mean over tokens

    def validate(self) -> None:
        if self.hang_timeout_s < 0 or self.compile_timeout_s < 0:
            raise ConfigError(
                f"resilience.hang_timeout_s={self.hang_timeout_s} and compile_timeout_s={self.compile_timeout_s} "
                "must be >= 0 (0: off)"
            )
        if self.spike_zscore <= 0:
            raise ConfigError(f"resilience.spike_zscore={self.spike_zscore} must be > 0")
        if self.spike_window < 3 or self.spike_warmup < 3:
            raise ConfigError(
                f"resilience.spike_window={self.spike_window} and spike_warmup={self.spike_warmup} must be >= 3"
            )
        if self.max_rollbacks < 0:
            raise ConfigError(f"resilience.max_rollbacks={self.max_rollbacks} must be >= 0")
        if self.routing_warmup < 0:
            raise ConfigError(f"resilience.routing_warmup={self.routing_warmup} must be >= 0")
        if self.routing_window < 1:
            raise ConfigError(f"resilience.routing_window={self.routing_window} must be >= 1")
        if not self.routing_max_load_ratio > 1 or not 0 < self.routing_max_skip_drift <= 1:
            raise ConfigError(
                "resilience.routing_max_load_ratio must be > 1 and routing_max_skip_drift in (0, 1]"
            )
        if not 0 <= self.routing_min_entropy < 1:
            raise ConfigError(f"resilience.routing_min_entropy={self.routing_min_entropy} must be in [0, 1)")


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
        they are checked again once the device count fills them)."""
        known = {axis: size for axis, size in sizes.items() if size > 0}
        if self.model.num_experts % known.get("expert", 1):
            raise ConfigError(
                f"model.num_experts={self.model.num_experts} is not divisible by mesh.expert={known['expert']}; "
                "choose an expert axis size that divides the number of experts"
            )
        shards = [axis for axis in ("data", "fsdp", "expert") if axis in known]
        split = math.prod(known[axis] for axis in shards)
        batch_sizes = {self.train.batch_size, *(p.batch_size for p in self.train.batch_ramp)}
        for size in sorted(batch_sizes):
            per_micro = size // self.train.micro_batches
            if per_micro % split:
                raise ConfigError(
                    f"a micro-batch of {per_micro} sequences (batch {size} / train.micro_batches="
                    f"{self.train.micro_batches}) is not divisible by {' x '.join(f'mesh.{a}' for a in shards)}"
                    f" = {split}; make every batch size a multiple of {split * self.train.micro_batches}"
                )
        context = known.get("context", 1)
        chunks = 2 * context if context > 1 and self.mesh.context_layout == "zigzag" else context
        seq_lens = {self.train.seq_len, *(s.seq_len for s in self.train.stages)}
        for seq_len in sorted(seq_lens):
            if seq_len % chunks:
                layout = (
                    f" in {chunks} zig-zag chunks (mesh.context_layout=zigzag)" if chunks != context else ""
                )
                raise ConfigError(
                    f"sequence length {seq_len} is not divisible by mesh.context={context}{layout}; "
                    f"use sequence lengths that are multiples of {chunks}"
                    + (" or set mesh.context_layout=contiguous" if layout else "")
                )


# ---------------------------------------------------------------------------------------------
# Loading
