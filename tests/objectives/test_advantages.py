"""GRPO's advantages and loss average: advantages centred in each group and, with
``rl.scale_advantages``, divided by its std; the loss averaged over completion tokens
(``rl.loss_norm: token``) or per completion (``sequence``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import load_config
from zaya_jax.loss import policy
from zaya_jax.objectives.rollout_rows import group_advantages


def test_unscaled_advantages_keep_the_rewards_differences():
    rewards = np.asarray([0.50, 0.51, 0.0, 1.0, 0.3, 0.3], np.float32)
    groups = ["a", "a", "b", "b", "c", "c"]
    scaled, _ = group_advantages(groups, rewards)
    plain, std = group_advantages(groups, rewards, scale=False)
    # scaled, a group whose rewards differ by 0.01 pushes as hard as one that is right or wrong
    np.testing.assert_allclose(scaled[:4], [-1, 1, -1, 1], rtol=1e-4)
    np.testing.assert_allclose(plain, [-0.005, 0.005, -0.5, 0.5, 0, 0], atol=1e-6)
    assert std == pytest.approx((0.005 + 0.5 + 0) / 3)


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_the_loss_averages_over_tokens_or_completions(monkeypatch, norm):
    cfg = load_config("grpo", [f"rl.loss_norm={norm}"])
    mask = jnp.asarray([[1, 1, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]], jnp.float32)  # 6 tokens and 1
    logp = jnp.full(mask.shape, -1.0)
    monkeypatch.setattr(policy, "token_nll", lambda *args: (-logp, None, {}))
    batch = {"loss_mask": mask, "sampler_logprobs": logp, "advantages": jnp.asarray([[1.0] * 6, [-2.0] * 6]),
             "segment_ids": jnp.ones(mask.shape, jnp.int32)}  # fmt: skip
    loss, stats = policy.grpo_loss_and_stats(None, {}, {}, batch, cfg)
    # ratio 1: each token's surrogate is -advantage
    if norm == "token":
        assert float(stats["weight"]) == 7 and float(loss / stats["weight"]) == pytest.approx((-6 + 2) / 7)
    else:
        assert float(stats["weight"]) == 2 and float(loss / stats["weight"]) == pytest.approx((-1 + 2) / 2)
    assert float(stats["tokens"]) == 7
