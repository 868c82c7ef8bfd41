"""The ``model`` section: the ZAYA1 architecture and how it is computed (MoE path, attention kernel,
rematerialisation, precision), with the sizes derived from it."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from zaya_jax.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling of one layer type, as transformers' ``rope_parameters`` entry defines it:
    ``linear`` divides every frequency by ``factor``; ``yarn`` divides the low frequencies by
    ``factor``, keeps the high ones, blends those between (``beta_fast`` / ``beta_slow`` rotations
    over ``original_max_position_embeddings``) and scales cos/sin by ``attention_factor`` (default
    0.1 ln(factor) + 1)."""

    rope_type: Literal["linear", "yarn"] = "yarn"  # linear: every frequency / factor; yarn: blended
    factor: float = 1.0  # how many times the original context the positions stretch over
    original_max_position_embeddings: int | None = None  # yarn: the context trained before extension
    beta_fast: float | None = None  # yarn: rotations below which a dimension is interpolated (null: 32)
    beta_slow: float | None = None  # yarn: rotations above which it is kept (null: 1)
    attention_factor: float | None = None  # yarn: cos/sin scale (null: from factor, mscale)
    mscale: float | None = None  # yarn: with mscale_all_dim, attention_factor's DeepSeek form
    # yarn: attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float | None = None

    def validate(self, key: str) -> None:
        if not self.factor >= 1.0:
            raise ConfigError(f"{key}.factor={self.factor} must be >= 1 (the context grows)")
        if self.rope_type == "yarn" and not (self.original_max_position_embeddings or 0) > 0:
            raise ConfigError(
                f"{key}.original_max_position_embeddings is needed by yarn: the context the model "
                "was trained at before the extension (e.g. 4096)"
            )
        for name in ("beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{key}.{name}={value} must be > 0 (or null)")


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
    # RoPE scaling of full-attention layers (HF rope_parameters.hybrid; null: none)
    rope_scaling: RopeScaling | None = None
    rope_scaling_sliding: RopeScaling | None = None  # of sliding-window layers (hybrid_sliding)
    rope_truncate: bool = True  # yarn's blend bounds rounded to whole dims (HF rope_parameters.truncate)
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
    # The experts' weights read through quantize-dequantize, as a quantized export stores them
    # (zaya_jax.ops.quantization): "fp8" (e4m3, a scale per output channel) or "mxfp4" (e2m1, a
    # power-of-two scale per 32 inputs); "none": as held. To measure a quantized model (zaya eval
    # --quantize), sample with one (rl.sampler_quantization) or train against one (gradients pass
    # straight through the rounding). A quantized export read back sets it.
    expert_quantization: Literal["none", "fp8", "mxfp4"] = "none"
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
    # keeps the weight-matmul outputs (but o_proj's) and recomputes the rest, "full" keeps only each
    # block's input.
    remat: Literal["none", "minimal", "full"] = "none"
    # Layers per iteration of the scan over blocks: 1 keeps one compiled block (compile time and
    # program size independent of depth); num_layers unrolls the loop, which lets XLA skip stacking
    # each layer's saved activations (faster on CPU and for shallow models; slower to compile).
    scan_unroll: int = 1
    # Custom-call kernels for the model's hot ops (attention when attention_impl is auto, CCA's
    # query/key steps, the MoE GEMMs, the attention merge + norm), resolved once per program into a
    # kernel plan (zaya_jax.ops.kernel_plan; the start event and `zaya doctor` show it): "auto" (the
    # calls measured faster than XLA on the platform: on a CPU attention, CCA and the grouped GEMM),
    # "kernel" (every op's custom call on the platform, the fused norm included; refused where the
    # kernel library is not built) or "reference" (pure JAX: no custom call in the program).
    kernels: Literal["auto", "kernel", "reference"] = "auto"
    # Mixed precision: parameters are stored in param_dtype, matmuls run in dtype; the residual
    # stream is always float32 (spec §2.1).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Storage dtype of the parameters (and of the Muon/AdamW moments).
    param_dtype: Literal["float32", "bfloat16"] = "float32"

    def architecture(self) -> ModelConfig:
        """This config with the fields that say only how it is computed (:data:`EXECUTION_FIELDS`)
        at their defaults: equal architectures, the same function up to float rounding. A run
        resumes with another kernel, attention implementation or remat policy."""
        return dataclasses.replace(self, **{name: _DEFAULTS[name] for name in EXECUTION_FIELDS})

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
        if self.kernels == "reference" and self.attention_impl in ("cpu", "pallas", "cudnn"):
            raise ConfigError(
                f"model.attention_impl={self.attention_impl} is a custom call and model.kernels=reference runs "
                "none; use model.attention_impl=blocked (or dense), or model.kernels=auto"
            )
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
        for name in ("rope_scaling", "rope_scaling_sliding"):
            if getattr(self, name) is not None:
                getattr(self, name).validate(f"model.{name}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"model.{name}={value} must be in [0, model.vocab_size={self.vocab_size})")
        if self.expert_quantization == "mxfp4" and (self.hidden_size % 32 or self.moe_intermediate_size % 32):
            raise ConfigError(
                f"model.expert_quantization=mxfp4 shares a scale over 32 inputs: model.hidden_size="
                f"{self.hidden_size} and model.moe_intermediate_size={self.moe_intermediate_size} must be "
                "multiples of 32; use fp8 (a scale per output channel)"
            )
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


# The fields of ModelConfig that choose how the model is computed, not what it computes.
EXECUTION_FIELDS = ("kernels", "attention_impl", "attention_block", "remat", "scan_unroll")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
