"""The lm-evaluation-harness model ``zaya``: its scores equal the model's own log-probabilities and
lm-eval's ``hf`` model's on the export, tiny multiple-choice tasks (local JSON, no network) run end
to end through lm-eval's command line (with the chat template) and over two processes."""

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


def _tiny_task(tmp_path, sums=((1, 2), (3, 4), (5, 6))) -> str:
    """A multiple-choice task of one question per pair in ``sums`` from a local JSON file; returns its name."""
    docs = [
        {
            "question": f"{a} + {b} =",
            "choices": [f" {a + b}", f" {a + b + 1}", f" {a + b} or so"],
            "answer": 0,
        }
        for a, b in sums
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


def test_generate_until_samples_when_asked_and_is_greedy_otherwise(run):
    """``do_sample`` with a temperature draws each repeat from its own stream (fixed by ``seed``);
    without it every repeat is the greedy text."""
    from zaya_jax.harness import ZayaLM

    model = ZayaLM(str(run), seed=3)
    sampled = {"until": [], "max_gen_toks": 8, "do_sample": True, "temperature": 1.0}
    greedy = {"until": [], "max_gen_toks": 8}
    requests = [_request("def ", sampled)] * 4 + [_request("def ", greedy)] * 4
    texts = model.generate_until(requests)
    assert len(set(texts[:4])) > 1 and len(set(texts[4:])) == 1
    assert texts == ZayaLM(str(run), seed=3).generate_until(requests)  # the seed fixes the draws


def _hf_reference(path, **args):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(path), dtype="float32", device="cpu", batch_size=4, **args)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A run trained with an HF tokenizer that has a BOS and a chat template (ChatML), and its export."""
    from tests.data.corpora import chat_tokenizer_dir, small_corpus_override

    tmp_path = tmp_path_factory.mktemp("chat")
    bpe = chat_tokenizer_dir(tmp_path / "tok") / "tokenizer.json"
    run = tmp_path / "run"
    args = [*MINI, "model.vocab_size=400", f"data.tokenizer={bpe}", small_corpus_override(tmp_path)]
    assert main(["train", *args, f"run.dir={run}", "train.steps=2", "--no-progress"]) == 0
    assert main(["convert", "zaya-to-hf", str(run), str(tmp_path / "hf")]) == 0
    return run, tmp_path / "hf"


def test_log_likelihoods_equal_lm_eval_hf_on_the_export(chat_run):
    """Each loglikelihood (an empty context included: scored after the tokenizer's BOS, as hf
    does) within 1e-4 of lm-eval's ``hf`` model on the export, with the same greedy flags, and
    rolling log-likelihoods over several windows equal too."""
    from zaya_jax.harness import ZayaLM

    run, hf = chat_run
    ours, theirs = ZayaLM(str(run), max_length=24), _hf_reference(hf, max_length=24)
    assert ours.prefix_token_id == theirs.prefix_token_id != ours.eot_token_id
    pairs = [
        ("what is two plus two", " four"),
        ("what is two plus two", " the answer is four"),
        ("what is two plus two ", "five"),  # a trailing space moves to the continuation
        ("", "the answer is four"),
        ("user assistant system " * 4, "what is two plus two"),  # longer than max_length: truncated
        ("the answer is", " four"),
    ]
    requests = [_request(*pair) for pair in pairs]
    got, want = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=1e-4)
    assert [g[1] for g in got] == [w[1] for w in want]
    texts = [_request("what is two plus two? the answer is four. " * 3), _request("hello")]
    np.testing.assert_allclose(
        ours.loglikelihood_rolling(texts), theirs.loglikelihood_rolling(texts), atol=1e-4
    )


def test_apply_chat_template_through_the_command_line_scores_as_hf_on_the_export(chat_run, tmp_path):
    """``python -m zaya_jax.harness run --apply_chat_template --fewshot_as_multiturn`` on the run
    renders every request as lm-eval's ``hf`` model renders it on the export (the run's template,
    exported) and gives the same scores and accuracy."""
    import subprocess
    import sys

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    run, hf = chat_run
    task = _tiny_task(tmp_path, sums=((1, 2), (3, 4), (5, 6), (7, 8)))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "zaya_jax.harness", "run", "--model", "zaya"]
    command += ["--model_args", f"pretrained={run}", "--tasks", task, "--include_path", str(tmp_path)]
    command += ["--apply_chat_template", "--fewshot_as_multiturn", "--num_fewshot", "1", "--seed", "5"]
    command += ["--log_samples", "--output_path", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    ours = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])
    theirs = simple_evaluate(
        model=_hf_reference(hf),
        tasks=[task],
        task_manager=TaskManager(include_path=str(tmp_path)),
        apply_chat_template=True,
        fewshot_as_multiturn=True,
        num_fewshot=1,
        random_seed=5,
        numpy_random_seed=5,
        torch_random_seed=5,
        fewshot_random_seed=5,
        log_samples=True,
    )["samples"][task]
    theirs = sorted(theirs, key=lambda s: s["doc_id"])
    requests = [[[a["arg_0"], a["arg_1"]] for a in s["arguments"].values()] for s in ours]
    assert requests == [[list(a) for a in s["arguments"]] for s in theirs]  # rendered alike
    context = requests[0][0][0]  # the one-shot example as an earlier turn, then the question
    assert context.startswith("<|im_start|>user\n") and context.endswith("<|im_start|>assistant\n")
    assert context.count("<|im_start|>user") == 2

    def scores(rows):
        return [[float(r[0]) for r in row["filtered_resps"]] for row in rows]

    np.testing.assert_allclose(scores(ours), scores(theirs), atol=1e-4)
    assert [s["acc"] for s in ours] == [s["acc"] for s in theirs]


_TWO_PROCESS = """
import json, os, sys
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from zaya_jax.harness import ZayaLM
model = ZayaLM(sys.argv[1])
scored = []
score = model._loglikelihood_tokens
model._loglikelihood_tokens = lambda requests, **kw: (scored.append(len(requests)), score(requests, **kw))[1]
results = simple_evaluate(model=model, tasks=[sys.argv[2]], task_manager=TaskManager(include_path=sys.argv[3]),
                          log_samples=True)
print("SHARE", sum(scored))
if results is not None:
    samples = sorted(results["samples"][sys.argv[2]], key=lambda s: s["doc_id"])
    print("REPORT", json.dumps({"rank": model.rank, "world": model.world_size,
                      "scores": [[float(r[0]) for r in s["filtered_resps"]] for s in samples]}))
"""


def test_two_processes_score_a_task_as_one(run, tmp_path):
    """Two processes (jax.distributed) each score their share of a task's requests; rank 0 gathers
    and reports the scores one process gives, and rank 1 reports nothing."""
    import subprocess
    import sys

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from tests.parallel.processes import _free_port
    from zaya_jax.harness import ZayaLM

    task = _tiny_task(tmp_path, sums=[(a, a + 1) for a in range(7)])
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "ZAYA_COORDINATOR": f"127.0.0.1:{port}",
            "ZAYA_NUM_PROCESSES": "2",
            "ZAYA_PROCESS_ID": str(rank),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _TWO_PROCESS, str(run), task, str(tmp_path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outputs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    reports = [
        json.loads(line.removeprefix("REPORT "))
        for out, _ in outputs
        for line in out.splitlines()
        if line.startswith("REPORT ")
    ]
    assert len(reports) == 1 and reports[0]["rank"] == 0 and reports[0]["world"] == 2
    shares = [
        int(line.split()[1]) for out, _ in outputs for line in out.splitlines() if line.startswith("SHARE ")
    ]
    assert len(shares) == 2 and 0 < min(shares) <= max(shares) < 7 * 3  # each scored a part (lm-eval pads)
    one = simple_evaluate(
        model=ZayaLM(str(run)),
        tasks=[task],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = sorted(one["samples"][task], key=lambda s: s["doc_id"])
    expected = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    assert len(expected) == 7
    np.testing.assert_allclose(reports[0]["scores"], expected, atol=1e-5)
