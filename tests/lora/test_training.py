"""LoRA training through ``zaya train``: the adapters train and the base stays bit for bit what it
was; checkpoints hold the adapters and a record of their base, and a resume after SIGKILL is
bit-identical to the uninterrupted run; adapters on another base, or that would never train, are
refused by name; dpo and grpo train adapters; exports (merged, PEFT) are exact in transformers."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import peft
import pytest

import zaya_jax
from tests.fixtures import MINI
from tests.hf_reference import hf_logits, transformers
from tests.resilience import faults
from zaya_jax import checkpoint
from zaya_jax.checkpoint.base import saved_base
from zaya_jax.checkpoint.fingerprint import digest
from zaya_jax.cli import main
from zaya_jax.data.tasks import reverse_pairs, write_jsonl
from zaya_jax.model import Zaya
from zaya_jax.model.lowrank import adapter_part, base_part, merged

SHAPE = [o for o in MINI if not o.startswith("model.")]  # the model comes from the base
LORA = [
    "lora.rank=4",
    "balancing.enabled=false",
    "optim.adam_lr=3e-3",
    "optim.warmup_steps=0",
    "--no-progress",
]
IDS = np.random.default_rng(5).integers(3, 250, size=(2, 12))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base trained 4 steps (its CCA temperature has left 0, so q and k have gradients)."""
    path = tmp_path_factory.mktemp("lora") / "base"
    assert main(["train", *MINI, f"run.dir={path}", "train.steps=4", "--no-progress"]) == 0
    return path


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
    """Two trees with the same structure and bit-identical arrays."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True)
    )


def _logits(model, params) -> np.ndarray:
    variables = {**model.variables, "params": params}
    return np.asarray(Zaya(model.config).apply(variables, IDS)[0], np.float32)


def test_a_lora_run_trains_its_adapters_saves_only_them_and_exports_exactly(base, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *SHAPE, "--init-from", str(base), f"run.dir={run}", "train.steps=4", *LORA]) == 0
    model, start = zaya_jax.load(run), zaya_jax.load(base)
    params = model.variables["params"]
    assert _same(base_part(params), start.variables["params"])
    assert all(np.any(leaf) for leaf in _leaves(adapter_part(params)))  # every A and B moved (B from 0)

    _, step, arrays = checkpoint.describe(run)
    assert set(arrays["params"]) == {"layers"} and set(arrays["params"]["layers"]) == {"lora"}
    record = saved_base(run / "checkpoints" / str(step))
    assert record["init_from"] == str(base) and record["dtype"] == "float32"
    assert record["fingerprint"] == digest({"params": start.variables["params"]})
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    norms = [line["lora_b_grad_norm"] for line in logged if "lora_b_grad_norm" in line]
    # one norm per adapter (7); q_proj's and k_proj's are small on this base, below the log's 4 digits
    assert norms and all(len(n) == 7 and min(n[1], *n[3:]) > 0 for n in norms)

    adapted = _logits(model, params)  # the adapters folded per block inside the scan
    assert np.abs(adapted - _logits(model, merged(params))).max() <= 1e-5 * np.abs(adapted).max()
    assert np.abs(adapted - _logits(model, base_part(params))).max() > 1e-3  # the adapters matter

    assert main(["convert", "zaya-to-hf", str(run), str(tmp_path / "plain")]) == 2
    assert "is a LoRA run: give --merge" in capsys.readouterr().err
    assert main(["convert", "zaya-to-hf", str(run), str(tmp_path / "merged"), "--merge"]) == 0
    hf = transformers.ZayaForCausalLM.from_pretrained(
        tmp_path / "merged", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    scale = np.abs(adapted).max()
    assert np.abs(hf_logits(hf, IDS) - adapted).max() <= 1e-4 * scale  # plain from_pretrained
    # --quantize merges the adapters first: the merged model with its experts in FP8
    fp8 = tmp_path / "fp8"
    assert (
        main(["convert", "zaya-to-hf", str(run), str(fp8), "--quantize", "fp8-experts", "--dtype", "float32"])
        == 0
    )
    quantized = dataclasses.replace(
        model, config=dataclasses.replace(model.config, expert_quantization="fp8")
    )
    expected = _logits(quantized, merged(params))
    assert np.abs(zaya_jax.load(fp8).logits(IDS) - expected).max() <= 1e-5 * scale
    assert np.abs(expected - adapted).max() > 1e-4 * scale  # the experts are quantized
    assert main(["convert", "zaya-to-hf", str(base), str(tmp_path / "base_hf")]) == 0
    assert main(["convert", "zaya-to-hf", str(run), str(tmp_path / "adapter"), "--adapter"]) == 0
    base_hf = transformers.ZayaForCausalLM.from_pretrained(
        tmp_path / "base_hf", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with_adapter = peft.PeftModel.from_pretrained(base_hf, tmp_path / "adapter").eval()
    assert np.abs(hf_logits(with_adapter, IDS) - adapted).max() <= 1e-4 * scale

    # the reverse: the PEFT directory as a model (its base named in adapter_config.json) and as the
    # start of a LoRA run, which continues its adapters on its base
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": str(tmp_path / "base_hf")})
    )
    imported = zaya_jax.load(tmp_path / "adapter")
    assert np.abs(_logits(imported, imported.variables["params"]) - adapted).max() <= 1e-5 * scale
    resumed = tmp_path / "from_peft"
    frozen_step = ["train.steps=1", "optim.warmup_steps=5"]  # the first step's learning rate is 0
    assert main(["train", *SHAPE, "--init-from", str(tmp_path / "adapter"), f"run.dir={resumed}", *LORA,
                 *frozen_step]) == 0  # fmt: skip
    assert _same(adapter_part(zaya_jax.load(resumed).variables["params"]), adapter_part(params))
    # adapters of another rank are merged into the base of a new run, which starts as that model
    rank8 = tmp_path / "r8"
    assert main(["train", *SHAPE, "--init-from", str(tmp_path / "adapter"), f"run.dir={rank8}", *LORA,
                 "lora.rank=8", "lora.alpha=64", *frozen_step]) == 0  # fmt: skip
    stacked = zaya_jax.load(rank8)
    assert np.abs(_logits(stacked, stacked.variables["params"]) - adapted).max() <= 1e-5 * scale
    assert stacked.variables["params"]["layers"]["lora"]["experts"]["wi"]["a"].shape[-1] == 8


def _train(run, base, *extra, prefix=(sys.executable, "-m", "zaya_jax.cli"), check=True):
    cmd = [*prefix, "train", *SHAPE, "--init-from", str(base), f"run.dir={run}", "train.steps=6",
           "log.every=1", "checkpoint.every_steps=2", *LORA, *extra]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert not check or result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(run) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def test_resume_after_sigkill_is_bit_identical_and_another_base_is_refused(base, tmp_path):
    reference = tmp_path / "reference"
    _train(reference, base)
    run = tmp_path / "killed"
    crashed = _train(run, base, prefix=faults.command("crash_at_step=5"), check=False)
    assert crashed.returncode == -signal.SIGKILL and max(_losses(run)) == 5
    _train(run, base)  # the same command: the base loaded again, the adapters restored from step 4
    assert _losses(run) == _losses(reference)
    ours, theirs = zaya_jax.load(run).variables["params"], zaya_jax.load(reference).variables["params"]
    assert _same(adapter_part(ours), adapter_part(theirs))

    # the base moves under a run's adapters: resuming it, or loading it, is refused, nothing set aside
    moved = tmp_path / "moved_base"
    shutil.copytree(base, moved)
    short = tmp_path / "short"
    result = _train(short, moved, "train.steps=2")
    shutil.rmtree(moved)
    assert main(["train", *MINI, f"run.dir={moved}", "train.steps=3", "--no-progress"]) == 0
    result = _train(short, moved, check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "were trained on a base with fingerprint" in result.stderr and str(moved) in result.stderr
    assert sorted(p.name for p in (short / "checkpoints").iterdir()) == ["2"]
    assert not (short / "quarantine").exists()
    with pytest.raises(checkpoint.store.BaseMismatchError, match="Restore the original base weights"):
        zaya_jax.load(short)


def test_an_adapter_that_gets_no_gradient_stops_the_run_by_name(tmp_path, capsys):
    """A freshly initialised base has CCA temperature 0: attention is uniform, q and k get no
    gradient, and their adapters would never train (the step-1 guard)."""
    fresh = tmp_path / "fresh"
    cfg = zaya_jax.load_config("tiny", [*MINI, f"run.dir={fresh}"])
    checkpoint.save_model(fresh, cfg, zaya_jax.model.init_variables(cfg.model, 0))
    run = tmp_path / "run"
    assert main(["train", *SHAPE, "--init-from", str(fresh), f"run.dir={run}", "train.steps=2", *LORA]) == 2
    err = capsys.readouterr().err
    assert "layers/attn/k_proj/kernel, layers/attn/q_proj/kernel received no gradient at step 1," in err
    assert "lora.targets=['experts', 'attention']" in err and "Traceback" not in err


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_post_training_objectives_train_adapters_on_a_frozen_base(base, tmp_path, monkeypatch, objective):
    run = tmp_path / objective
    # a reward that tells this base's completions apart (the reverse task's is 0 for all of them)
    (tmp_path / "zr_spread.py").write_text(
        "def score(record, text):\n    return float(sum(map(ord, text)) % 7)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = ["train.batch_size=4", "rl.group_size=2", "rl.max_new_tokens=4", "rl.eval_prompts=4",
             "train.seq_len=64", "rl.reward=zr_spread:score", "rl.kl=0.1", "log.every=1"] if objective == "grpo" else [
        f"data.sources=[{{name: pairs, kind: preference, path: {write_jsonl(tmp_path / 'p.jsonl', reverse_pairs(24, seed=1))}}}]",
        "train.seq_len=128", "data.held_out_fraction=0.2"]  # fmt: skip
    args = ["train", objective, *SHAPE, "--init-from", str(base), f"run.dir={run}", "train.steps=2", *LORA]
    assert main([*args, "eval.every=2", "eval.batches=1", *extra]) == 0
    params = zaya_jax.load(run).variables["params"]
    start = zaya_jax.load(base).variables["params"]
    assert _same(base_part(params), start)
    assert np.any(np.asarray(adapter_part(params)["layers"]["lora"]["experts"]["wi"]["b"]))  # B left 0
    if objective == "grpo":  # the KL reference is the base (adapters switched off): 0 at step 1
        kl = [json.loads(line).get("kl") for line in (run / "metrics.jsonl").read_text().splitlines()]
        kl = [value for value in kl if value is not None]
        assert abs(kl[0]) < 1e-6 and kl[1] > 0, kl
