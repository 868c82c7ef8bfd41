"""GRPO's correction for a sampler that is not the trainer (:mod:`zaya_jax.loss.policy`): truncated
and masked importance weights, per token and per completion, GSPO's sequence ratio and the mismatch
metrics, each against a NumPy reference written from the papers' formulas; rows hold two
completions each (segments), as packed rows will."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import ConfigError, RLConfig
from zaya_jax.loss.policy import importance_weights, policy_terms

ROWS, SEQ = 3, 12


def _batch(seed: int = 0, spread: float = 0.6) -> dict[str, np.ndarray]:
    """Rows of two completions (segments 1 and 2, each a prompt token then completion tokens) and
    padding, sampler log-probabilities ``spread`` nats from the trainer's."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((ROWS, SEQ), np.int32)
    mask = np.zeros((ROWS, SEQ), np.float32)
    for row, (a, b) in enumerate([(5, 4), (3, 7), (6, 2)]):
        segments[row, :a], segments[row, a : a + b] = 1, 2
        mask[row, 1:a], mask[row, a + 1 : a + b] = 1, 1  # each segment's first token is its prompt
    logp = -rng.uniform(0.1, 3.0, (ROWS, SEQ)).astype(np.float32)
    sampler = (logp + rng.normal(0, spread, logp.shape)).astype(np.float32)
    advantages = np.where(segments == 1, 0.8, -1.1) * np.asarray([1.0, -0.5, 2.0])[:, None]
    return {
        "logp": logp,
        "loss_mask": mask,
        "segment_ids": segments,
        "sampler_logprobs": np.where(mask > 0, sampler, 0.0).astype(np.float32),
        "advantages": advantages.astype(np.float32),
    }


def _per_completion(values: np.ndarray, batch: dict[str, np.ndarray]) -> np.ndarray:
    """Each token's completion's sum of ``values`` over its completion tokens (the reference)."""
    out = np.zeros_like(values)
    for row in range(ROWS):
        for s in (1, 2):
            here = batch["segment_ids"][row] == s
            out[row, here] = (values[row] * batch["loss_mask"][row])[here].sum()
    return out


def _numpy_weights(batch, level: str, cap: float, bound: float):
    log_w = (batch["logp"] - batch["sampler_logprobs"]) * batch["loss_mask"]
    if level == "sequence":
        log_w = _per_completion(log_w, batch)
    w = np.exp(log_w.astype(np.float64))
    masked = (w < 1 / bound) | (w > bound) if bound else np.zeros(w.shape, bool)
    truncated = (w > cap) & ~masked if cap else np.zeros(w.shape, bool)
    w = np.where(masked, 0.0, np.minimum(w, cap) if cap else w)
    on = batch["loss_mask"] > 0
    return np.where(on, w, 1.0), truncated & on, masked & on


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(("cap", "bound"), [(2.0, 0.0), (0.0, 2.5), (1.5, 3.0)])
def test_importance_weights_truncate_and_mask_as_the_numpy_reference(level, cap, bound):
    batch = _batch(seed=0 if level == "token" else 2, spread=0.8 if level == "token" else 0.4)
    rl = RLConfig(tis_cap=cap, tis_mask=bound, tis_level=level)
    w, truncated, masked = importance_weights(
        jnp.asarray(batch["logp"]), batch["sampler_logprobs"], batch["loss_mask"], batch["segment_ids"], rl
    )
    want_w, want_truncated, want_masked = _numpy_weights(batch, level, cap, bound)
    on = batch["loss_mask"] > 0
    np.testing.assert_allclose(np.asarray(w)[on], want_w[on], rtol=2e-6)
    np.testing.assert_array_equal(np.asarray(truncated) > 0, want_truncated)
    np.testing.assert_array_equal(np.asarray(masked) > 0, want_masked)
    # the batch exercises each bound it sets: some weights changed, some kept
    for bound_set, changed in ((cap, want_truncated), (bound, want_masked)):
        if bound_set:
            assert 0 < changed.sum() < on.sum()
    if level == "sequence":  # one weight per completion
        for row in range(ROWS):
            for s in (1, 2):
                here = on[row] & (batch["segment_ids"][row] == s)
                assert np.unique(np.asarray(w)[row, here]).size == 1


def test_an_overflowing_sequence_weight_is_truncated_or_masked_never_nan():
    batch = _batch(spread=0.0)
    batch["sampler_logprobs"] = np.where(batch["loss_mask"] > 0, batch["logp"] - 200.0, 0.0).astype(
        np.float32
    )
    for rl in (RLConfig(tis_cap=2.0, tis_level="sequence"), RLConfig(tis_mask=2.0, tis_level="sequence")):
        w, _, _ = importance_weights(
            jnp.asarray(batch["logp"]),
            batch["sampler_logprobs"],
            batch["loss_mask"],
            batch["segment_ids"],
            rl,
        )
        assert np.isfinite(np.asarray(w)).all()
        assert set(np.unique(np.asarray(w)[batch["loss_mask"] > 0])) == {2.0 if rl.tis_cap else 0.0}


def _terms(batch: dict[str, np.ndarray], rl: RLConfig, logp: jax.Array | None = None):
    fields = {k: jnp.asarray(v) for k, v in batch.items() if k != "logp"}
    return policy_terms(jnp.asarray(batch["logp"]) if logp is None else logp, fields, rl)


def test_the_corrected_loss_weights_the_surrogate_and_its_gradient_is_the_weighted_policy_gradient():
    """With a correction, one step per rollout: the ratio is pi / pi_old with pi_old the trainer
    itself (ratio 1, never clipped), so the gradient with respect to each token's log-probability
    is -w A (times the token's weight); uncorrected it is the clipped ratio against the sampler."""
    batch = _batch()
    on = batch["loss_mask"] > 0
    rl = RLConfig(tis_cap=2.0, tis_level="token")
    w, _, _ = _numpy_weights(batch, "token", 2.0, 0.0)

    def loss(logp):
        per_token, weights, _, _ = _terms(batch, rl, logp)
        return jnp.sum(per_token * weights)

    value, grad = jax.value_and_grad(loss)(jnp.asarray(batch["logp"]))
    np.testing.assert_allclose(
        float(value), float(np.sum(np.where(on, -w * batch["advantages"], 0))), rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(grad), np.where(on, -w * batch["advantages"], 0), rtol=1e-5, atol=1e-7
    )

    plain = RLConfig(clip_low=0.2, clip_high=0.28)
    per_token, weights, stats, _ = _terms(batch, plain)
    ratio = np.exp(batch["logp"] - batch["sampler_logprobs"])
    a = batch["advantages"]
    want = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.28) * a)
    np.testing.assert_allclose(np.asarray(per_token)[on], want[on], rtol=1e-5)
    assert 0 < float(jnp.sum(stats["clip_fraction"] * weights)) < on.sum()  # the clip is exercised


@pytest.mark.parametrize("loss_norm", ["token", "sequence"])
def test_gspo_clips_one_ratio_per_completion(loss_norm):
    """GSPO (rl.ratio=sequence): s = exp(mean over the completion of log pi - log pi_old), the
    surrogate -min(s A, clip(s) A) for each of its tokens; with rl.loss_norm=sequence the loss is
    the sum of the completions' surrogates, and its gradient is s A / |y| on each token unless clipped."""
    batch = _batch(spread=0.05)
    on = batch["loss_mask"] > 0
    rl = RLConfig(ratio="sequence", clip_low=3e-3, clip_high=4e-3, loss_norm=loss_norm)
    per_token, weights, stats, _ = _terms(batch, rl)
    lengths = _per_completion(np.ones_like(batch["logp"]), batch)
    s = np.exp(_per_completion(batch["logp"] - batch["sampler_logprobs"], batch) / np.maximum(lengths, 1))
    a = batch["advantages"]
    want = -np.minimum(s * a, np.clip(s, 1 - 3e-3, 1 + 4e-3) * a)
    np.testing.assert_allclose(np.asarray(per_token)[on], want[on], rtol=1e-5)
    want_weights = np.where(on, 1.0 / lengths if loss_norm == "sequence" else 1.0, 0.0)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-6)
    clipped = np.asarray(stats["clip_fraction"])[on]
    assert 0 < clipped.sum() < on.sum()  # some completions clipped as a whole, some not
    if loss_norm == "sequence":
        grad = jax.grad(lambda lp: jnp.sum(jnp.prod(jnp.stack(_terms(batch, rl, lp)[:2]), axis=0)))(
            jnp.asarray(batch["logp"])
        )
        free = np.where(on & ~(np.asarray(stats["clip_fraction"]) > 0), -s * a / lengths, 0.0)
        np.testing.assert_allclose(np.asarray(grad)[free != 0], free[free != 0], rtol=1e-4)


def test_mismatch_metrics_are_the_numpy_estimates():
    batch = _batch(spread=0.3)
    on = batch["loss_mask"] > 0
    _, weights, stats, extremes = _terms(batch, RLConfig())
    d = (batch["logp"] - batch["sampler_logprobs"]).astype(np.float64)[on]
    rho = np.exp(d)
    mean = {name: float(jnp.sum(stats[name] * weights) / jnp.sum(weights)) for name in stats}
    np.testing.assert_allclose(mean["mismatch_kl"], np.mean(rho - 1 - d), rtol=1e-5)
    np.testing.assert_allclose(mean["mismatch_chi2"], np.mean(rho**2 - 1), rtol=1e-5)
    np.testing.assert_allclose(mean["sampler_gap"], np.mean(np.abs(d)), rtol=1e-5)
    np.testing.assert_allclose(float(extremes["max_ratio"]), rho.max(), rtol=1e-6)
    np.testing.assert_allclose(float(extremes["min_ratio"]), rho.min(), rtol=1e-6)
    assert "tis_masked" not in stats  # reported with a correction only
    corrected = _terms(batch, RLConfig(tis_mask=1.5))[2]
    assert float(jnp.sum(corrected["tis_masked"])) == np.sum((rho < 1 / 1.5) | (rho > 1.5))


def test_bad_correction_settings_are_refused_naming_the_key():
    for fields, key in (({"tis_cap": 0.5}, "rl.tis_cap=0.5"), ({"tis_mask": 1.0}, "tis_mask=1.0")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            dataclasses.replace(RLConfig(), **fields).validate()


def test_a_sampler_with_quantized_experts_shows_in_the_mismatch_metrics(tmp_path):
    """rl.sampler_quantization: rollouts sampled with MXFP4 experts, trained in full precision. The
    trainer's log-probabilities then differ from the sampler's by far more than zaya's own sampler
    (~1e-8 on this model), the mismatch metrics see it, and rl.tis_cap weights it out."""
    from tests.fixtures import GRPO
    from zaya_jax.cli import main
    from zaya_jax.config import load_config
    from zaya_jax.objectives import check

    run = tmp_path / "run"
    settings = ["train.steps=1", "eval.every=100", "rl.sampler_quantization=mxfp4", "rl.tis_cap=2"]
    assert main(["train", *GRPO, *settings, f"run.dir={run}", "--no-progress"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(m for m in lines if m["step"] == 1 and "sampler_gap" in m)
    assert first["sampler_gap"] > 1e-6 and first["mismatch_chi2"] > 0
    assert first["max_ratio"] > 1 > first["min_ratio"]  # pi_old / pi_sampler on both sides of 1
    with pytest.raises(ConfigError, match="multiples of 32"):
        check(load_config("tiny", [*GRPO, "rl.sampler_quantization=mxfp4", "model.moe_intermediate_size=48"]))
