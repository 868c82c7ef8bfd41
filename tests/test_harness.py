"""The lm-evaluation-harness model ``zaya``: its scores equal the model's own log-probabilities, and
a tiny multiple-choice task (local JSON, no network) runs end to end through ``simple_evaluate``."""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

# No network: the task's data is a local JSON file (datasets reads these before it is imported).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from tests.fixtures import MINI  # noqa: E402
from zaya_jax.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("harness") / "run"
    assert main(["train", *MINI, f"run.dir={path}", "train.steps=2", "--no-progress"]) == 0
    return path


def _request(*args):
    return types.SimpleNamespace(args=args)


def _logprob(lm, ids: list[int], start: int) -> float:
    """sum log p(ids[t] | ids[:t]) for t >= start, from one unpadded forward."""
    logits = lm.logits(np.asarray([ids[:-1]]))[0].astype(np.float64)
    logprobs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    return float(sum(logprobs[t - 1, ids[t]] for t in range(start, len(ids))))


def test_scores_are_the_models_log_probabilities(run):
    from zaya_jax.harness import ZayaLM

    model = ZayaLM(str(run))
    tok, lm = model.tok, model.lm
    ((score, greedy),) = model.loglikelihood([_request("def add(a, b):", " return a + b")])
    ids = [int(t) for t in tok.encode("def add(a, b): return a + b")]
    context = len(tok.encode("def add(a, b):"))
    assert score == pytest.approx(_logprob(lm, ids, context), abs=1e-3)
    assert isinstance(greedy, bool)
    (rolling,) = model.loglikelihood_rolling([_request("import os\n")])
    text = [model.prefix_token_id, *[int(t) for t in tok.encode("import os\n")]]
    assert rolling == pytest.approx(_logprob(lm, text, 1), abs=1e-3)
    (generated,) = model.generate_until([_request("def ", {"until": ["\n"], "max_gen_toks": 8})])
    assert "\n" not in generated and len(generated) <= 8


def test_generate_until_runs_a_task_at_once_and_cuts_each_text_at_its_own_stop(run):
    """Requests with different stops and lengths, through two engine slots, give the texts of
    each request generated alone, cut before the first of its ``until`` strings."""
    from zaya_jax.harness import ZayaLM

    model = ZayaLM(str(run), slots=2)
    contexts = ["def ", "import", "class A", "x = "]
    alone = model.lm.generate(contexts, max_new_tokens=12, stop_tokens=[]).texts
    stops = [alone[0][3:5], "\x00never", alone[2][6], ""]  # strings each text is known to hold (or not)
    options = [{"until": [stop], "max_gen_toks": 12 - i} for i, stop in enumerate(stops)]
    texts = model.generate_until([_request(c, o) for c, o in zip(contexts, options, strict=True)])
    for text, whole, stop, i in zip(texts, alone, stops, range(4), strict=True):
        expected = whole[: whole.find(stop)] if stop and stop in whole else whole
        # a row without a stop string keeps its own max_gen_toks (byte tokenizer: one char per token)
        assert text == (
            expected if stop in whole and stop else model.tok.decode(model.tok.encode(whole)[: 12 - i])
        )


def _tiny_task(tmp_path) -> str:
    """A 3-question multiple-choice task from a local JSON file; returns its name."""
    docs = [
        {"question": f"{a} + {b} =", "choices": [f" {a + b}", f" {a + b + 1}"], "answer": 0}
        for a, b in [(1, 2), (3, 4), (5, 6)]
    ]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tiny.yaml").write_text(
        f"""task: zaya_tiny_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "docs.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    return "zaya_tiny_sums"


def test_a_tiny_task_runs_end_to_end(run, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from zaya_jax.harness import ZayaLM

    _tiny_task(tmp_path)
    results = simple_evaluate(
        model=ZayaLM(str(run)), tasks=["zaya_tiny_sums"], task_manager=TaskManager(include_path=str(tmp_path))
    )
    accuracy = results["results"]["zaya_tiny_sums"]["acc,none"]
    assert accuracy in (0.0, 1 / 3, 2 / 3, 1.0)
    assert results["n-samples"]["zaya_tiny_sums"]["effective"] == 3


def test_an_export_scores_the_same_with_lm_eval_hf(tmp_path):
    """``zaya convert zaya-to-hf`` output (weights, tokenizer files) loads in ``lm_eval --model hf``
    and gives the same per-choice log-likelihoods as the ``zaya`` model on the run itself."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from tests.data.corpora import small_corpus_override, train_bpe_tokenizer
    from zaya_jax.harness import ZayaLM

    bpe = train_bpe_tokenizer(tmp_path / "bpe.json")
    run = tmp_path / "run"
    args = [
        "train",
        *MINI,
        "model.vocab_size=304",
        f"data.tokenizer={bpe}",
        small_corpus_override(tmp_path),
        f"run.dir={run}",
        "train.steps=2",
    ]
    assert main([*args, "--no-progress"]) == 0
    assert main(["convert", "zaya-to-hf", str(run), str(tmp_path / "hf")]) == 0
    task = _tiny_task(tmp_path)
    manager = TaskManager(include_path=str(tmp_path))
    ours = simple_evaluate(model=ZayaLM(str(run)), tasks=[task], task_manager=manager, log_samples=True)
    from lm_eval.models.huggingface import HFLM

    reference = HFLM(pretrained=str(tmp_path / "hf"), dtype="float32", device="cpu")
    theirs = simple_evaluate(model=reference, tasks=[task], task_manager=manager, log_samples=True)

    def scores(results):
        return [[float(r[0]) for r in sample["filtered_resps"]] for sample in results["samples"][task]]

    np.testing.assert_allclose(scores(ours), scores(theirs), atol=1e-3)
