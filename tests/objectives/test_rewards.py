"""GRPO's inputs end in one line naming what to change: a reward module that does not import, a
reward function that raises or returns something that is not a number (stopped, or skipped and
counted with ``rl.on_reward_error: skip``), rollout files with impossible values, NaN settings."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.fixtures import MINI
from zaya_jax.cli import main
from zaya_jax.config import ConfigError, load_config
from zaya_jax.data import DataError, load_tokenizer
from zaya_jax.objectives.rewards import PromptEncoder, PromptSet
from zaya_jax.objectives.rollout_files import read_rollout_files
from zaya_jax.objectives.rollout_rows import Completion
from zaya_jax.objectives.rollouts import Rollouts
from zaya_jax.rewards.calls import RewardError, RewardFunction, load_reward

RECORD = {"messages": [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]}


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """A working directory for reward modules, not on sys.path (as under the ``zaya`` script)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("zr_")]:
        del sys.modules[name]


def test_a_reward_module_in_the_working_directory_is_found(module_dir):
    (module_dir / "zr_found.py").write_text("def score(record, text):\n    return 1.0\n")
    assert load_reward("zr_found:score")(RECORD, "x") == 1.0
    assert str(module_dir) not in sys.path  # looked in, not left there


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("raise RuntimeError('no GPU here')\n", r"zr_bad\.py:1\): RuntimeError: no GPU here"),
        ("def score(record, text)\n", "SyntaxError"),
        ("import zr_missing_dep\n", r"zr_bad\.py:1\): ModuleNotFoundError: No module named 'zr_missing_dep'"),
    ],
)
def test_a_reward_module_that_fails_to_import_is_one_line(module_dir, source, expected):
    (module_dir / "zr_bad.py").write_text(source)
    with pytest.raises(ConfigError, match=expected) as err:
        load_reward("zr_bad:score")
    assert "rl.reward='zr_bad:score'" in str(err.value)


def test_a_missing_reward_module_says_where_modules_are_found(module_dir):
    with pytest.raises(ConfigError, match="working directory, PYTHONPATH or an installed package"):
        load_reward("zr_nowhere:score")


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("raise KeyError('answer')", "raised KeyError: 'answer'"),
        ("return None", "returned None (NoneType), not a finite number"),
        ("return 'good'", "returned 'good' (str), not a finite number"),
        ("return float('nan')", "returned nan (float), not a finite number"),
        ("import sys; sys.exit(3)", "raised SystemExit: 3"),
    ],
)
def test_a_reward_function_that_fails_names_itself_and_the_prompt(module_dir, body, problem):
    (module_dir / "zr_fn.py").write_text(f"def score(record, text):\n    {body}\n")
    stop = RewardFunction("zr_fn:score")
    with pytest.raises(RewardError, match=r"rl\.on_reward_error=skip") as err:
        stop(RECORD, "x")
    assert (
        problem in str(err.value) and "zr_fn:score" in str(err.value) and "'reverse: abc'" in str(err.value)
    )
    skip = RewardFunction("zr_fn:score", on_error="skip")
    assert skip(RECORD, "x") is None and skip(RECORD, "y") is None
    assert skip.errors == 2 and problem in skip.problem


def test_booleans_and_numpy_numbers_are_rewards(module_dir):
    (module_dir / "zr_ok.py").write_text(
        "import numpy as np\ndef score(record, text):\n    return np.float32(0.5) if text else True\n"
    )
    reward = RewardFunction("zr_ok:score")
    assert reward(RECORD, "x") == 0.5 and reward(RECORD, "") == 1.0


def test_a_skipped_group_trains_nothing_and_is_counted(module_dir):
    (module_dir / "zr_skip.py").write_text("def score(record, text):\n    return len(text)\n")
    cfg = load_config(
        "tiny", [*MINI, "train.objective=grpo", "rl.reward=zr_skip:score", "rl.on_reward_error=skip"]
    )
    events = []
    rollouts = Rollouts(
        cfg, load_tokenizer("byte"), event=lambda name, **detail: events.append((name, detail))
    )
    rollouts.reward.problem = "rl.reward=zr_skip:score raised ..."
    one = np.ones(2, np.int32)
    completions = [Completion(g, one, one, np.zeros(2, np.float32), r, None) for g, r in
                   [(0, 1.0), (0, 3.0), (1, None), (1, 5.0)]]  # fmt: skip
    rows, _ = rollouts._rows(completions)
    advantages = [float(row["advantages"][row["loss_mask"] > 0][0]) for row in rows]
    assert advantages[2:] == [0.0, 0.0] and advantages[0] < 0 < advantages[1]
    stats = dict(rollouts.stats)
    assert stats["reward_errors"] == 1.0 and stats["reward"] == 2.0  # the mean of the scored group
    assert events == [("reward_error", {"groups": 1, "first": "rl.reward=zr_skip:score raised ..."})]


def _rollout_file(path, **changes):
    record = {
        "group": 0,
        "prompt_ids": [5, 6],
        "completion_ids": [7, 2],
        "logprobs": [-0.5, -0.1],
        "reward": 1.0,
    }
    path.write_text(json.dumps({**record, **changes}) + "\n")
    return path


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        (
            {"completion_ids": [7, 9000]},
            r"completion_ids holds id 9000, outside the model's vocabulary \[0, 512\)",
        ),
        ({"prompt_ids": [-1, 6]}, "prompt_ids holds id -1"),
        ({"prompt_ids": [5.5, 6]}, "prompt_ids must be a non-empty list of token ids"),
        ({"logprobs": [float("nan"), -0.1]}, "logprobs must be finite"),
        ({"logprobs": [0.7, -0.1]}, r"logprobs must be finite log-probabilities \(<= 0\)"),
        ({"reward": float("nan")}, "reward nan is not a finite number"),
        ({"reward": "good"}, "could not convert string to float"),
    ],
)
def test_a_rollout_record_with_impossible_values_is_refused_with_its_line(tmp_path, changes, problem):
    path = _rollout_file(tmp_path / "rollouts.jsonl", **changes)
    cfg = load_config("tiny", [*MINI, "model.vocab_size=512", "train.objective=grpo", f"rl.rollouts={path}"])
    with pytest.raises(DataError, match=rf"rollouts\.jsonl:1: not a rollout record \(.*{problem}"):
        read_rollout_files(cfg)


@pytest.mark.parametrize(
    "setting",
    [
        "rl.temperature=.nan",
        "rl.kl=.nan",
        "rl.clip_high=.inf",
        "preference.beta=.nan",
        "preference.simpo_gamma=.nan",
    ],
)
def test_a_setting_that_is_not_a_number_is_refused(setting):
    with pytest.raises(ConfigError, match=setting.split("=")[0].replace(".", r"\.") + r"=(nan|inf)"):
        load_config("tiny", [setting])


def test_grpo_with_a_reward_module_that_fails_stops_before_compiling(module_dir, capsys):
    (module_dir / "zr_broken.py").write_text("1 / 0\n")
    args = ["train", *MINI, "train.objective=grpo", "rl.group_size=2", "rl.reward=zr_broken:score"]
    assert main([*args, f"run.dir={module_dir / 'run'}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "ZeroDivisionError" in err and "zr_broken.py:1" in err and "Traceback" not in err
    assert "compiling" not in err and len(err.strip().splitlines()) == 1


def test_a_prompt_from_a_file_is_named_by_its_line_when_it_fails(module_dir):
    """A reward error and a prompt too long for the sampler name the ``rl.prompts`` line."""
    path = module_dir / "prompts.jsonl"
    records = [RECORD] * 6 + [{"messages": [{"role": "user", "content": "q" * 500}]}] * 6
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(
        "tiny", [*MINI, "train.objective=grpo", f"rl.prompts={path}", "data.held_out_fraction=0.3"]
    )
    prompts = PromptSet(cfg)
    (module_dir / "zr_fails.py").write_text("def score(record, text):\n    raise KeyError('answer')\n")
    first = prompts.record(0)
    with pytest.raises(RewardError, match=rf"\({path}:\d+\)"):
        RewardFunction("zr_fails:score")(first, "x")
    long = next(prompts.record(i) for i in range(12) if "q" * 10 in json.dumps(prompts.record(i)))
    encode = PromptEncoder(cfg, load_tokenizer("byte"), 64)
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: a prompt of \d+ tokens does not fit"):
        encode([long])
