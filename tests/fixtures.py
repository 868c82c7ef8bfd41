"""The models, configs and helpers that more than one test module uses. Test modules import them
from here (or from the helper modules beside them: ``tests/random_model.py``, ``tests/data/corpora.py``,
``tests/parallel/processes.py``, ...), never from another ``test_*.py`` module
(``tests/test_fixtures.py`` checks)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tests.random_model import TINY
from zaya_jax.config import Config, OptimConfig, RunConfig, TrainConfig

# The miniature model of most ``zaya train`` tests (overrides of the ``tiny`` preset): 2 layers of
# width 32, 2 experts, batches of 2 x 32 tokens, a log line every 2 steps and an evaluation every 3.
MINI = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.num_experts=2",
    "model.moe_intermediate_size=32",
    "model.router_hidden_size=8",
    "train.batch_size=2",
    "train.seq_len=32",
    "log.every=2",
    "eval.every=3",
    "eval.batches=1",
]

# GRPO: 2 groups of 4 completions of up to 8 tokens per rollout, rewarded by ascii_reward, a log line
# every step; GRPO_SETTINGS on any model and mesh (tests/parallel/processes.py), GRPO on the miniature one.
GRPO_SETTINGS = [
    "train.objective=grpo",
    "train.batch_size=8",
    "train.seq_len=64",
    "rl.group_size=4",
    "rl.max_new_tokens=8",
    "rl.eval_prompts=4",
    "rl.reward=tests.fixtures:ascii_reward",
    "optim.warmup_steps=1",
    "balancing.enabled=false",
    "log.every=1",
]
GRPO = [*MINI, *GRPO_SETTINGS]


def ascii_reward(record, completion: str) -> float:
    """A reward an untrained byte model's random completions already vary in."""
    return float(sum(c.isascii() for c in completion))


def half_tied_reward(record, completion: str) -> float:
    """:func:`ascii_reward` for reverse-task words starting with n-z; 0 for every completion of the
    others (a group whose rewards all tie)."""
    word = record["messages"][0]["content"].split(": ", 1)[1]
    return ascii_reward(record, completion) if word[0] >= "n" else 0.0


def even_first_character(record, completion: str) -> float:
    """A checker an untrained byte model's sampled answers pass about half the time: 1.0 when the
    reply's first character has an even code point, 0.0 when odd, and an empty reply unparsed."""
    from zaya_jax.rewards import Score, reply_text

    reply = reply_text(completion)
    return Score(float(ord(reply[0]) % 2 == 0)) if reply else Score(0.0, parsed=False)


def tiny_train_config(**train) -> Config:
    """The randomised-model tests' ``TINY`` model in a train config (rows of 16 tokens, 60 steps,
    5 warm-up steps); ``train`` overrides TrainConfig's fields."""
    cfg = Config(
        run=RunConfig(name="test"),
        model=TINY,
        train=TrainConfig(**{"seq_len": 16, "steps": 60, **train}),
        optim=OptimConfig(warmup_steps=5),
    )
    cfg.validate()
    return cfg


def synthetic_batch(seed: int, batch: int, seq: int, vocab: int = TINY.vocab_size) -> dict[str, jnp.ndarray]:
    """Rows holding two packed documents and trailing padding, in the data pipeline's format."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab, size=(batch, seq + 1))
    segment_ids = np.zeros((batch, seq), np.int32)
    positions = np.zeros((batch, seq), np.int32)
    for row in range(batch):
        cut, end = rng.integers(3, seq - 4), seq - rng.integers(0, 3)
        segment_ids[row, :cut], segment_ids[row, cut:end] = 1, 2
        positions[row, :cut], positions[row, cut:end] = np.arange(cut), np.arange(end - cut)
    loss_mask = (segment_ids > 0).astype(np.float32)
    return {
        "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
        "segment_ids": jnp.asarray(segment_ids),
        "positions": jnp.asarray(positions),
        "loss_mask": jnp.asarray(loss_mask),
    }
