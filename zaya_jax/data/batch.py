"""The batch format every producer and consumer shares: (rows, seq) arrays per batch.

Every batch has ``inputs`` and ``targets`` (token ids), ``segment_ids`` (1, 2, ... per document in a
row; 0 = padding), ``positions`` (index within the segment) and ``loss_mask`` (1 on trained pairs,
0 on padding and on untrained tokens). :mod:`zaya_jax.data.pipeline` describes how rows are packed.

Post-training objectives add fields, each declared by its objective's loss binding
(:class:`zaya_jax.loss.Objective`, ``fields``; :mod:`zaya_jax.objectives`): ``reference_logps``
(dpo, ipo: each sequence's reference log-probability on its segment's first position), and for
grpo ``sampler_logprobs``, ``advantages``, ``reference_logprobs`` (with ``rl.kl > 0``) per target,
and ``routes`` (rows, seq, layers), the sampler's classes (replayed with ``rl.replay_routes``, else
compared: ``route_flips``).
"""

from __future__ import annotations

import numpy as np

BATCH_FIELDS: dict[str, type[np.generic]] = {
    "inputs": np.int32,
    "targets": np.int32,
    "segment_ids": np.int32,
    "positions": np.int32,
    "loss_mask": np.float32,
}
BATCH_KEYS = tuple(BATCH_FIELDS)


def empty_row(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """A row of padding: ``pad_id`` tokens, segment 0, no loss."""
    row = {key: np.zeros(seq_len, dtype) for key, dtype in BATCH_FIELDS.items()}
    row["inputs"][:] = pad_id
    row["targets"][:] = pad_id
    return row
