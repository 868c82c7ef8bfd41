"""GRPO: group-normalised advantages, rows that line up each completion token with its sampler
log-probability, advantage and replayed routes; a run whose training forward reproduces the
sampler's log-probabilities (router replay) and moves the policy; rollouts (with routes) read from
files; held-out reward evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.fixtures import GRPO
from zaya_jax.cli import main
from zaya_jax.config import load_config
from zaya_jax.data import load_tokenizer
from zaya_jax.generate import generate
from zaya_jax.model import init_variables
from zaya_jax.objectives.rollout_rows import Completion, completion_row, group_advantages


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_advantages_and_rows_line_up_with_the_completion():
    advantages, group_std = group_advantages(["a", "a", "b", "b", "a"], np.asarray([1.0, 0.0, 2.0, 2.0, 2.0]))
    assert abs(group_std - np.std([1, 0, 2]) / 2) < 1e-6  # the mean of the groups' stds (b's is 0)
    np.testing.assert_allclose(
        advantages[[0, 1, 4]], (np.asarray([1, 0, 2]) - 1) / np.std([1, 0, 2]), rtol=1e-6
    )
    assert advantages[2] == advantages[3] == 0.0  # no signal in a group of equal rewards

    cfg = load_config("tiny", [*GRPO, "train.seq_len=16", "rl.max_new_tokens=4"])
    routes = np.arange(7 * cfg.model.num_layers).reshape(7, -1) % (cfg.model.num_experts + 1)
    completion = Completion(
        "g", np.asarray([5, 6, 7, 8]), np.asarray([9, 10, 1]), np.asarray([-0.5, -1.0, -2.0]), 1.0, routes[:6]
    )
    row = completion_row(cfg, completion, 0.75, pad_id=0, vocab_limit=260)
    assert row["inputs"][:6].tolist() == [5, 6, 7, 8, 9, 10] and row["targets"][:6].tolist() == [
        6,
        7,
        8,
        9,
        10,
        1,
    ]
    assert row["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1] + [0] * 10  # the targets 9, 10 and EOS
    assert (
        row["sampler_logprobs"][3:6].tolist() == [-0.5, -1.0, -2.0] and row["sampler_logprobs"].sum() == -3.5
    )
    assert (row["advantages"][3:6] == 0.75).all() and row["advantages"].sum() == 0.75 * 3
    np.testing.assert_array_equal(row["routes"][:6], routes[:6])
    assert (row["routes"][6:] == -1).all() and row["segment_ids"].tolist() == [1] * 6 + [0] * 10
    assert (row["vocab_limit"] == 260).all()  # the ids the sampler could draw
    with pytest.raises(ValueError, match=r"does not fit train\.seq_len=16"):
        completion_row(cfg, Completion("g", np.arange(12), np.arange(8), np.zeros(8), 0.0, None), 0.0, 0, 260)


def test_grpo_replays_the_sampler_and_moves_the_policy(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *GRPO, f"run.dir={run}", "train.steps=2", "eval.every=2", "--no-progress"]) == 0
    records = _records(run)
    steps = [r for r in records if "loss" in r]
    first = steps[0]
    assert records[0]["step"] == 0 and "eval_reward" in records[0]  # where the run started
    # On the first step the trained weights are the sampler's: with the routes replayed the training
    # forward reproduces every sampled token's log-probability, so the importance ratio is 1.
    assert first["sampler_gap"] < 1e-5 and abs(first["ratio"] - 1) < 1e-5 and first["clip_fraction"] == 0
    assert first["reward"] > 0 and first["reward_group_std"] > 0 and first["zero_advantage"] < 1
    assert first["grad_norm"] > 0  # advantages that vary move the policy
    evaluated = [r for r in records if "eval_reward" in r]
    assert [r["step"] for r in evaluated] == [0, 2] and evaluated[-1]["eval_loss"] == -evaluated[-1][
        "eval_reward"
    ]
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0  # the run's held-out reward, reproduced
    assert json.loads(capsys.readouterr().out)["reward"] == evaluated[-1]["eval_reward"]

    # Resumed: the rollout position continues (another rollout, other prompts).
    assert main(["train", *GRPO, f"run.dir={run}", "train.steps=3", "eval.every=3", "--no-progress"]) == 0
    state = json.loads((run / "events.jsonl").read_text().splitlines()[-1])["detail"]
    assert state["steps"] == 3

    # With a KL term the starting weights score every rollout; they start equal to the policy.
    kl = tmp_path / "kl"
    args = ["train", *GRPO, "--init-from", str(run), "rl.kl=0.1", "optim.warmup_steps=0", "log.every=1"]
    assert main([*args, f"run.dir={kl}", "train.steps=2", "eval.every=5", "--no-progress"]) == 0
    first, second = (r for r in _records(kl) if "kl" in r)
    assert first["kl"] < 1e-6 < second["kl"]  # then the policy moves away from them


def test_the_trainer_takes_log_probabilities_of_the_distribution_sampled(tmp_path):
    """Sampled at temperature 0.7 with top-k and top-p (and the byte tokenizer's 259 of the model's
    264 ids), the rollouts' log-probabilities are of that distribution, and so are the trainer's: on
    the first step the ratio is 1 (at temperature 1 the trainer would be 0.3 nats or more away,
    tests/engine/test_engine.py shows the sampler's differ from the model's own)."""
    run = tmp_path / "run"
    args = [*GRPO, "rl.temperature=0.7", "rl.top_k=40", "rl.top_p=0.9", "train.steps=1", "eval.every=5"]
    assert main(["train", *args, f"run.dir={run}", "--no-progress"]) == 0
    first = next(r for r in _records(run) if "loss" in r)
    assert first["sampler_gap"] < 1e-5 and abs(first["ratio"] - 1) < 1e-5 and first["grad_norm"] > 0
    # the mismatch metrics say the same: no distance between sampler and trainer
    assert first["mismatch_kl"] < 1e-9 and abs(first["mismatch_chi2"]) < 1e-4
    assert 1 - 1e-4 < first["min_ratio"] <= first["max_ratio"] < 1 + 1e-4


def test_a_corrected_rollout_trained_twice_takes_its_ratio_against_the_rollouts_parameters(tmp_path):
    """rl.tis_cap / rl.tis_mask with two steps per rollout: the rows carry the trainer's
    log-probabilities at the rollout's parameters (pi_old). On the rollout's first step the
    weights pi_old / pi_sampler are 1 (nothing truncated or masked) and so is the ratio; on its
    second the policy has moved, and the ratio against pi_old (not against itself) shows it."""
    run = tmp_path / "run"
    args = [*GRPO, "rl.steps_per_rollout=2", "rl.tis_cap=2", "rl.tis_mask=4", "rl.tis_level=sequence"]
    args += ["train.steps=2", "eval.every=5", "optim.warmup_steps=0"]
    assert main(["train", *args, f"run.dir={run}", "--no-progress"]) == 0
    first, second = (r for r in _records(run) if "loss" in r)
    for step in (first, second):
        assert step["tis_truncated"] == 0 and step["tis_masked"] == 0
    assert abs(first["ratio"] - 1) < 1e-5 and first["sampler_gap"] < 1e-5
    assert abs(second["ratio"] - 1) > 1e-4 and second["sampler_gap"] > 1e-4 and second["max_ratio"] > 1


def test_rollouts_with_routes_are_read_from_files(tmp_path, capsys):
    cfg = load_config("tiny", GRPO)
    tokenizer = load_tokenizer("byte")
    variables = init_variables(cfg.model, cfg.train.seed)
    prompts = [tokenizer.encode(f"<|user|>\nsay {w}<|end|>\n<|assistant|>\n").tolist() for w in ("a", "bb")]
    out = generate(
        cfg.model,
        variables,
        prompts * 4,
        max_new_tokens=6,
        temperature=1.0,
        stop_tokens=[],
        vocab_limit=tokenizer.vocab_size,  # the records' log-probabilities: over the tokenizer's ids
        return_routes=True,
    )
    path = tmp_path / "rollouts.jsonl"
    with path.open("w") as f:
        for i, row in enumerate(out.rows()):
            record = {
                "group": i % 2,
                "prompt_ids": prompts[i % 2],
                "completion_ids": row,
                "logprobs": out.logprobs[i, : len(row)].tolist(),
                "reward": float(i % 3),
                "routes": out.row_routes(i)[:-1].tolist(),
            }
            f.write(json.dumps(record) + "\n")
    run = tmp_path / "run"
    args = ["train", *GRPO, "train.steps=2", "eval.every=2", "--no-progress"]  # the program of the test above
    assert main([*args, f"rl.rollouts={path}", f"run.dir={run}"]) == 0
    first = next(r for r in _records(run) if "loss" in r)
    assert first["sampler_gap"] < 1e-5 and first["reward"] == np.mean([i % 3 for i in range(8)])

    bad = tmp_path / "bad.jsonl"
    record["routes"] = record["routes"][:-1]
    bad.write_text(path.read_text() + json.dumps(record) + "\n")
    capsys.readouterr()
    assert main([*args, f"rl.rollouts={bad}", f"run.dir={tmp_path / 'bad'}"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:9" in err and "routes have shape" in err


def test_prompts_from_a_file_split_reshuffle_and_name_bad_records(tmp_path):
    from zaya_jax.data import DataError
    from zaya_jax.data.tasks import reverse_chats, write_jsonl
    from zaya_jax.objectives.rewards import PromptSet
    from zaya_jax.rewards import prompt_messages

    path = write_jsonl(tmp_path / "prompts.jsonl", reverse_chats(200, seed=4))
    cfg = load_config(
        "tiny", [*GRPO, f"rl.prompts={path}", "data.held_out_fraction=0.1", "rl.eval_prompts=5"]
    )
    prompts = PromptSet(cfg)
    first_epoch = [prompts.record(i)["messages"][0]["content"] for i in range(len(prompts._records))]
    second_epoch = [
        prompts.record(len(first_epoch) + i)["messages"][0]["content"] for i in range(len(first_epoch))
    ]
    held_out = {r["messages"][0]["content"] for r in prompts.held_out}
    assert len(prompts.held_out) == 5 and not held_out & set(first_epoch)
    assert sorted(first_epoch) == sorted(second_epoch) and first_epoch != second_epoch  # reshuffled
    assert (
        len(first_epoch)
        + len(
            PromptSet(
                load_config(
                    "tiny",
                    [*GRPO, f"rl.prompts={path}", "data.held_out_fraction=0.1", "rl.eval_prompts=1000"],
                )
            ).held_out
        )
        == 200
    )
    assert [m["role"] for m in prompt_messages(prompts.record(0))] == ["user"]  # the answer is left out

    (tmp_path / "bad.jsonl").write_text(
        path.read_text() + '{"messages": [{"role": "robot", "content": "x"}]}\n'
    )
    with pytest.raises(DataError, match=r"bad\.jsonl:201: .*role 'robot'"):
        PromptSet(load_config("tiny", [*GRPO, f"rl.prompts={tmp_path / 'bad.jsonl'}"]))
    for empty in ([], [{"role": "assistant", "content": "only a reply"}]):
        (tmp_path / "empty.jsonl").write_text(path.read_text() + json.dumps({"messages": empty}) + "\n")
        with pytest.raises(DataError, match=r"empty\.jsonl:201: an empty prompt"):
            PromptSet(load_config("tiny", [*GRPO, f"rl.prompts={tmp_path / 'empty.jsonl'}"]))


def test_dynamic_sampling_replaces_groups_whose_rewards_tie(tmp_path):
    """rl.dynamic_sampling (DAPO): a reward that ties every completion of half the prompts; the
    rollouts replace those groups by further prompts' (every trained group has an advantage), and
    log the reward of everything sampled apart from the trained one's."""
    args = [*GRPO, "rl.reward=tests.fixtures:half_tied_reward", "train.steps=3", "eval.every=5"]
    dynamic = tmp_path / "dynamic"
    assert main(["train", *args, "rl.dynamic_sampling=4", f"run.dir={dynamic}", "--no-progress"]) == 0
    after = [r for r in _records(dynamic) if "loss" in r]
    assert all(r["zero_advantage"] == 0 for r in after)
    assert sum(r["groups_replaced"] for r in after) > 0  # tied groups were drawn, and replaced
    assert all(r["groups_replaced"] == 2 * (r["sample_rounds"] - 1) for r in after)  # 2 groups a round
    assert any(r["reward_sampled"] < r["reward"] for r in after)  # the tied groups' zeros are left out


@pytest.mark.parametrize("settings", [["rl.loss_norm=token"], ["rl.loss_norm=sequence", "rl.ratio=sequence"]])
def test_a_packed_batch_has_the_loss_and_gradient_of_the_unpacked_one(settings):
    """rl.pack: completions several to a row, each its own segment; the loss (token- or
    completion-normalised, GSPO's per-completion ratio included) and its gradient equal those of the
    same completions one to a row (<= 1e-6), in fewer rows."""
    import jax

    from zaya_jax.loss.policy import grpo_loss_and_stats
    from zaya_jax.model import BALANCING, Zaya
    from zaya_jax.objectives.rollout_rows import packed_rows

    cfg = load_config("tiny", [*GRPO, "train.seq_len=40", "rl.clip_low=0.01", "rl.clip_high=0.01", *settings])
    rng = np.random.default_rng(0)
    layers, classes = cfg.model.num_layers, cfg.model.num_experts + 1
    completions = []
    for i in range(8):
        prompt, tokens = rng.integers(3, 200, rng.integers(3, 9)), rng.integers(3, 200, rng.integers(1, 12))
        routes = rng.integers(0, classes, (len(prompt) + len(tokens) - 1, layers))
        logprobs = -rng.uniform(0.5, 4.0, len(tokens))
        completions.append(Completion(i // 4, prompt, tokens, logprobs, 0.0, routes))
    advantages = rng.normal(size=8).astype(np.float32)
    one_each = [
        completion_row(cfg, c, float(a), 0, 260) for c, a in zip(completions, advantages, strict=True)
    ]
    packed = packed_rows(cfg, completions, advantages, 0, 260, multiple=1)
    assert len(packed) < len(one_each) and max(int(r["segment_ids"].max()) for r in packed) > 1
    variables = init_variables(cfg.model, jax.random.key(0))
    model = Zaya(cfg.model)

    def loss(params, rows):
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        total, stats = grpo_loss_and_stats(model, params, variables[BALANCING], batch, cfg)
        return total / stats["weight"], stats

    (want, stats), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"], one_each)
    (got, packed_stats), packed_grads = jax.value_and_grad(loss, has_aux=True)(variables["params"], packed)
    assert abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
    assert float(stats["sums"]["clip_fraction"]) > 0  # the (tight) clip is exercised
    for name in ("clip_fraction", "ratio", "sampler_gap", "mismatch_kl"):
        np.testing.assert_allclose(float(packed_stats["sums"][name]), float(stats["sums"][name]), rtol=1e-5)
    for ours, theirs in zip(jax.tree.leaves(packed_grads), jax.tree.leaves(grads), strict=True):
        assert (
            np.abs(np.asarray(ours) - np.asarray(theirs)).max()
            <= 1e-6 + 1e-4 * np.abs(np.asarray(theirs)).max()
        )


def test_a_packed_run_trains_fewer_rows_and_reproduces_its_sampler(tmp_path):
    run = tmp_path / "run"
    args = [*GRPO, "rl.pack=true", "train.seq_len=128", "train.steps=2", "eval.every=5"]
    assert main(["train", *args, f"run.dir={run}", "--no-progress"]) == 0
    steps = [r for r in _records(run) if "loss" in r]
    assert all(r["batch_size"] < 8 and r["row_fill"] > 0.2 for r in steps)  # 8 completions in fewer rows
    assert (
        steps[0]["sampler_gap"] < 1e-5 and steps[0]["route_flips"] == 0 and abs(steps[0]["ratio"] - 1) < 1e-5
    )
