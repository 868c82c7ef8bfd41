"""The cuDNN path of the dispatcher (``impl="cudnn"``): ``jax.nn.dot_product_attention``, cuDNN's
fused kernel on NVIDIA GPUs in bf16/fp16 and XLA's elsewhere, for the one mask it can express
without a dense (seq, seq) array (causal self-attention); every other mask is refused with the
alternative named.
"""

from __future__ import annotations

import jax

from zaya_jax.ops.attention.masks import AttentionMask


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask) -> jax.Array:
    """q: (batch, seq, nq, d); k, v: (batch, seq, nk, d) -> (batch, seq, nq, d).
    ``jax.nn.dot_product_attention`` (cuDNN's fused kernel on NVIDIA GPUs, XLA's elsewhere) for
    the masks it can express without a dense (seq, seq) array: causal self-attention with no
    document ids, no padding keys and no sliding window."""
    unexpressed = [
        name
        for name, present in (
            ("not a sequence attending to itself", not mask.aligned),
            ("document ids (packed documents)", mask.q_segments is not None),
            ("padding keys", mask.k_valid is not None),
            ("a sliding window", mask.window is not None),
        )
        if present
    ]
    if unexpressed:
        raise ValueError(
            f"model.attention_impl=cudnn cannot express this mask ({', '.join(unexpressed)}); "
            "use attention_impl pallas or blocked"
        )
    # implementation=None: JAX takes cuDNN where it applies (NVIDIA GPUs, bf16/fp16), XLA elsewhere
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=None)
