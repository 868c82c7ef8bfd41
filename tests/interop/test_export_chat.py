"""An export evaluates and serves as the run was trained: ``zaya convert zaya-to-hf`` writes the
run's chat template into ``tokenizer_config.json`` (transformers' ``apply_chat_template`` on the
export renders a prompt as zaya rendered it), and its ``eos_token_id`` lists every id the run's
rollouts stopped on (the model's EOS joined with ``model.eos_token_ids``, the tokenizer's EOS and
the template's end of turn), so HF ``generate`` on the export stops where zaya's sampling does."""

from __future__ import annotations

import json

from tests.data.corpora import CHATML, chat_tokenizer_dir
from tests.fixtures import MINI
from tests.hf_reference import transformers
from zaya_jax.cli import main
from zaya_jax.data import load_tokenizer
from zaya_jax.data.chat import ChatEncoder, ChatTemplate

MESSAGES = [{"role": "user", "content": "what is two plus two"}]


def test_an_export_keeps_the_chat_template_and_every_stop(tmp_path):
    tok_dir = chat_tokenizer_dir(tmp_path / "tok")
    run = tmp_path / "run"
    overrides = [*MINI, f"run.dir={run}", "train.steps=1", f"data.tokenizer={tok_dir / 'tokenizer.json'}",
                 "model.vocab_size=400", "model.eos_token_ids=[7]"]  # fmt: skip
    assert main(["train", *overrides, "--no-progress"]) == 0
    assert main(["convert", "zaya-to-hf", str(run), str(tmp_path / "hf")]) == 0

    ours = load_tokenizer(tok_dir)
    im_end = ours._tok.token_to_id("<|im_end|>")
    stops = [1, 7, ours.eos_id, im_end]  # the model's EOS, its extra stop, the tokenizer's, the turn end
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (
        sorted(set(generation["eos_token_id"])) == sorted(set(stops)) == sorted(set(config["eos_token_id"]))
    )
    assert (
        transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id
        == generation["eos_token_id"]
    )

    saved = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == CHATML and saved["eos_token"] == "</s>"
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    rendered = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered == ChatEncoder(ours, ChatTemplate(CHATML, "test")).prompt(MESSAGES)
    assert rendered.endswith("<|im_start|>assistant\n")

    # zaya reads its own export back with the same stops
    import zaya_jax

    assert set(zaya_jax.load(tmp_path / "hf").stop_token_ids) == set(stops)
