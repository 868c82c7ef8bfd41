"""The one registry of logical axis names, for parameters and activations.

Model code names every parameter and activation axis with one of these names and knows nothing of
meshes. Everything else is derived from this table: the default logical-axis rules
(``zaya_jax.parallel.rules.DEFAULT_RULES``, from ``mesh``), the batch's sharding (the ``batch`` and
``seq`` axes), and the optimizer's Muon/AdamW grouping (``zaya_jax.optim.groups``, from ``role``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

# How the optimizer treats a parameter axis (see zaya_jax.optim.groups):
#   batch  - a stack of independent matrices; Newton-Schulz runs once per entry (per layer, per expert).
#   matrix - a hidden width a dense projection maps between; two of them make a Muon matrix.
#   adamw  - any leaf with this axis is AdamW.
AxisRole = Literal["batch", "matrix", "adamw"]


@dataclasses.dataclass(frozen=True)
class LogicalAxis:
    name: str
    doc: str
    mesh: tuple[str, ...] = ()  # the mesh axes that split it by default (() = replicated)
    role: AxisRole | None = None  # parameter axes only; None for activation-only axes


AXES: tuple[LogicalAxis, ...] = (
    # Activations
    LogicalAxis("batch", "rows of a batch", ("data", "fsdp", "expert")),
    LogicalAxis("seq", "sequence positions", ("context",)),
    LogicalAxis(
        "vocab_parallel",
        "the LM head inside the chunked loss: each chunk's logits split over the vocabulary (the head "
        "is resharded from its stored residual-width split once per step)",
        ("fsdp",),
    ),
    # Parameters
    LogicalAxis(
        "embed",
        "the residual width H: parameters and optimizer state sharded over FSDP, gathered where used",
        ("fsdp",),
        "matrix",
    ),
    LogicalAxis(
        "experts", "the expert stack: each expert shard holds E / |expert| experts", ("expert",), "batch"
    ),
    LogicalAxis("layers", "the scanned layer stack (added by nn.scan)", (), "batch"),
    LogicalAxis("heads", "the flattened query latent nq*d", (), "matrix"),
    LogicalAxis("kv", "the flattened key/value latent nk*d (and its halves)", (), "matrix"),
    LogicalAxis("expert_mlp", "an expert's hidden width (I, or 2I for fused gate/up)", (), "matrix"),
    LogicalAxis("router", "the router width R", (), "matrix"),
    LogicalAxis("router_mlp", "the router MLP's hidden width", (), "matrix"),
    # Muon's spectral-norm argument is for hidden-to-hidden maps; the embedding is a lookup table
    # (one sparse row per token) and the LM head a classifier.
    LogicalAxis("vocab", "vocabulary rows of the embedding / LM head", (), "adamw"),
    # The router's classifier head (R x (E+1)): its few columns would all get equal-norm updates,
    # fighting the balancing biases that steer the same logits.
    LogicalAxis("router_classes", "the E+1 router classes (E experts + the skip)", (), "adamw"),
    # CCA's two-stage q/k convolution: taps x channels / per-head d x d blocks over time, not a
    # projection between hidden widths.
    LogicalAxis("conv", "convolution taps", (), "adamw"),
    LogicalAxis("qk", "the C = (nq+nk)*d channels of the q/k convolution", (), "adamw"),
    LogicalAxis("qk_heads", "the nq+nk heads of the grouped convolution", (), "adamw"),
    LogicalAxis("head_dim", "one head's d channels", (), "adamw"),
    LogicalAxis("kv_heads", "one entry per KV head (the key temperature)", (), "adamw"),
)
AXIS = {axis.name: axis for axis in AXES}

# The residual stream between layers: rows and positions split like the batch, width whole (a
# no-op unless traced inside ``flax.linen.logical_axis_rules`` and a mesh, see ``Layout``).
ACTIVATION_AXES = ("batch", "seq", None)
# A (batch, seq) input array.
BATCH_AXES = ("batch", "seq")
