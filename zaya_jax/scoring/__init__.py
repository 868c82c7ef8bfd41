"""Sampled answers, checked and scored as reasoning models are reported: n answers per prompt
through the rollout engine, each checked by a reward function (:mod:`zaya_jax.rewards`), scored as
pass@k, avg@n and maj@k with standard errors (:mod:`~zaya_jax.scoring.metrics`), with the answers
cut by the token budget and those no checker could read counted apart
(:mod:`~zaya_jax.scoring.answers`). Below the objectives and evaluation layers, so that GRPO's
held-out evaluation (``rl.eval_samples``) and ``zaya eval --task`` (:mod:`zaya_jax.eval.reasoning`)
score with one piece of code."""
