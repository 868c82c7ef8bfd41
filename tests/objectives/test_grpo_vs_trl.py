"""GRPO's loss equals TRL's ``GRPOTrainer`` on the same fixed batch at temperature 0.7: the same
weights (the HF export), prompts, completions, advantages, sampler (old) and reference
log-probabilities, clip and KL weight. Per-token log-probabilities and the loss agree to 1e-5, every
parameter's gradient to 1e-4 of its largest entry, for the token-level loss (TRL's ``bnpo``), the
per-completion one (TRL's ``grpo``) and GSPO's sequence ratio. TRL, like zaya-jax, takes log-probabilities at the sampling
temperature (huggingface/trl#3029); it applies no top-k/top-p to them, so neither does this test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.data.corpora import chat_tokenizer_dir
from tests.fixtures import GRPO
from tests.hf_reference import torch, transformers
from tests.random_model import random_variables
from zaya_jax.config import load_config
from zaya_jax.interop.hf import save_hf_directory
from zaya_jax.interop.hf.weights import variables_to_hf
from zaya_jax.loss.forward import token_nll
from zaya_jax.loss.policy import grpo_loss_and_stats, sampling_distribution
from zaya_jax.model import BALANCING, Zaya

trl = pytest.importorskip("trl")  # pinned in the dev extra: a missing one skips here, fails CI's install
datasets = pytest.importorskip("datasets")

TEMPERATURE, KL = 0.7, 0.05
CLIPS = {"token": (0.2, 0.28), "sequence": (0.03, 0.04)}  # GSPO clips its sequence ratio tighter
PROMPT, COMPLETION = 6, 5
LENGTHS = (5, 3, 4, 5)  # each completion's tokens; the rest of its row is padding


def _setting(loss_norm: str, ratio: str = "token"):
    low, high = CLIPS[ratio]
    overrides = [
        f"rl.temperature={TEMPERATURE}",
        f"rl.kl={KL}",
        f"rl.clip_low={low}",
        f"rl.clip_high={high}",
        f"rl.loss_norm={loss_norm}",
        f"rl.ratio={ratio}",
        "train.seq_len=16",
    ]
    return load_config("tiny", [*GRPO, *overrides])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The random weights, their HF export loaded in transformers, and a tokenizer for TRL."""
    cfg = _setting("token")
    variables = random_variables(cfg.model, seed=7)
    directory = save_hf_directory(tmp_path_factory.mktemp("hf"), cfg.model, variables)
    chat_tokenizer_dir(directory)
    hf = transformers.ZayaForCausalLM.from_pretrained(
        directory, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    return variables, hf.eval(), transformers.AutoTokenizer.from_pretrained(directory)


def _batch(vocab: int):
    rng = np.random.default_rng(11)
    rows = len(LENGTHS)
    prompt = rng.integers(3, vocab, (rows, PROMPT))
    completion = rng.integers(3, vocab, (rows, COMPLETION))
    mask = (np.arange(COMPLETION)[None] < np.asarray(LENGTHS)[:, None]).astype(np.int64)
    advantages = np.asarray([1.0, -0.5, 0.3, -0.8], np.float32)
    return prompt, completion, mask, advantages


def _trl_loss(hf, tokenizer, tmp_path, loss_type, ratio, prompt, completion, mask, advantages, old, ref):
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / loss_type),
        temperature=TEMPERATURE,
        beta=KL,
        epsilon=CLIPS[ratio][0],
        epsilon_high=CLIPS[ratio][1],
        loss_type=loss_type,
        importance_sampling_level=ratio,
        router_aux_loss_coef=0.0,  # ZAYA balances with biases, no auxiliary loss (TRL adds the config's)
        use_bias_correction_kl=False,  # the k3 KL as GRPO's paper writes it (TRL's default weights it by the ratio)
        per_device_train_batch_size=len(LENGTHS),
        num_generations=len(LENGTHS),
        max_completion_length=COMPLETION,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trainer = trl.GRPOTrainer(
        model=hf,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["x"] * len(LENGTHS)}),
        processing_class=tokenizer,
    )
    model = trainer.model.eval()
    model.zero_grad()
    inputs = {
        "prompt_ids": torch.as_tensor(prompt),
        "prompt_mask": torch.ones_like(torch.as_tensor(prompt)),
        "completion_ids": torch.as_tensor(completion),
        "completion_mask": torch.as_tensor(mask),
        "advantages": torch.as_tensor(advantages),
        "old_per_token_logps": torch.as_tensor(old),
        "ref_per_token_logps": torch.as_tensor(ref),
        "num_items_in_batch": torch.as_tensor(float(mask.sum())),
    }
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = {name: p.grad.detach().numpy() for name, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps = trainer._get_per_token_logps_and_entropies(model, ids, attention, COMPLETION)[0]
    return float(loss.detach()), logps.numpy(), grads


def _ours(cfg, variables, prompt, completion, mask, advantages, old, ref):
    """zaya-jax's GRPO loss on the same batch (a row: prompt + completion, completion targets
    trained), its per-token log-probabilities at the completion and the parameters' gradients in
    HF's layout."""
    rows, seq = len(LENGTHS), PROMPT + COMPLETION - 1
    sequence = np.concatenate([prompt, completion], axis=1)
    trained = np.zeros((rows, seq), np.float32)
    trained[:, PROMPT - 1 :] = mask
    segments = np.ones((rows, seq), np.int32)
    for row, n in enumerate(LENGTHS):
        segments[row, PROMPT - 1 + n :] = 0  # padding after the completion
    per_token = np.zeros((rows, seq), np.float32)
    batch = {
        "inputs": sequence[:, :-1],
        "targets": sequence[:, 1:],
        "segment_ids": segments,
        "positions": np.broadcast_to(np.arange(seq), (rows, seq)),
        "loss_mask": trained,
        "advantages": trained * advantages[:, None],
        "sampler_logprobs": per_token.copy(),
        "reference_logprobs": per_token.copy(),
        "vocab_limit": np.full((rows, seq), cfg.model.vocab_size, np.int32),  # TRL scores every id
    }
    batch["sampler_logprobs"][:, PROMPT - 1 :] = old * mask
    batch["reference_logprobs"][:, PROMPT - 1 :] = ref * mask
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    model, balancing = Zaya(cfg.model), variables[BALANCING]

    def loss(params):
        total, stats = grpo_loss_and_stats(model, params, balancing, batch, cfg)
        return total / stats["weight"]

    value, grads = jax.jit(jax.value_and_grad(loss))(variables["params"])
    nll = token_nll(model, variables["params"], balancing, batch, distribution=sampling_distribution(cfg))[0]
    logps = -np.asarray(nll)[:, PROMPT - 1 :]
    hf_grads = variables_to_hf(
        {"params": grads, BALANCING: jax.tree.map(jnp.zeros_like, balancing)}, cfg.model
    )
    return float(value), logps, hf_grads


@pytest.mark.parametrize(
    ("loss_norm", "loss_type", "ratio"),
    [("token", "bnpo", "token"), ("sequence", "grpo", "token"), ("sequence", "grpo", "sequence")],
)
def test_the_loss_its_log_probabilities_and_gradients_equal_trls(
    exported, tmp_path, loss_norm, loss_type, ratio
):
    """Token ratios with TRL's bnpo and grpo losses, and GSPO's sequence ratio (TRL's
    ``importance_sampling_level="sequence"``, zaya's ``rl.ratio=sequence``)."""
    variables, hf, tokenizer = exported
    cfg = _setting(loss_norm, ratio)
    prompt, completion, mask, advantages = _batch(cfg.model.vocab_size)
    _, current, _ = _ours(cfg, variables, prompt, completion, mask, advantages, *np.zeros((2, 4, COMPLETION)))
    rng = np.random.default_rng(5)  # sampler and reference a little off the policy: ratios clip, KL > 0
    old = (current + rng.normal(0, 0.25, current.shape)).astype(np.float32)
    ref = (current + rng.normal(0, 0.25, current.shape)).astype(np.float32)

    value, logps, grads = _ours(cfg, variables, prompt, completion, mask, advantages, old, ref)
    trl_value, trl_logps, trl_grads = _trl_loss(
        hf, tokenizer, tmp_path, loss_type, ratio, prompt, completion, mask, advantages, old, ref
    )
    real = mask > 0
    np.testing.assert_allclose(logps[real], trl_logps[real], atol=1e-5)
    assert abs(value - trl_value) <= 1e-5 * max(1.0, abs(trl_value)), (value, trl_value)
    log_ratio = np.where(real, trl_logps - old, 0.0)
    if ratio == "sequence":  # one ratio per completion
        log_ratio = np.broadcast_to(
            log_ratio.sum(-1, keepdims=True) / real.sum(-1, keepdims=True), real.shape
        )
    ratios = np.exp(log_ratio)[real]
    low, high = CLIPS[ratio]
    clipped = (ratios < 1 - low) | (ratios > 1 + high)
    assert clipped.any() and not clipped.all()  # the clip is exercised
    # at temperature 1 the log-probabilities would be another distribution's
    plain = load_config("tiny", [*GRPO, "train.seq_len=16"])
    at_one = _ours(plain, variables, prompt, completion, mask, advantages, old, ref)[1]
    assert np.abs(at_one - logps)[real].mean() > 0.05
    for name, theirs in trl_grads.items():
        if name == "lm_head.weight":  # tied: its gradient is the embedding's
            continue
        ours = grads[name]
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max() + 1e-9, name
    assert set(trl_grads) - {"lm_head.weight"} <= set(grads) and len(trl_grads) > 20
