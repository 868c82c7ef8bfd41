"""lm-evaluation-harness integration (the ``[eval]`` extra): an ``lm_eval`` model named ``zaya``.

``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` run on :func:`zaya_jax.load`
(a run, a checkpoint or an HF directory), so a run is scored with the harness without exporting it::

    python -m zaya_jax.harness run --model zaya --model_args pretrained=runs/tiny --tasks TASKS \\
        [--apply_chat_template] [--fewshot_as_multiturn]

(``lm_eval``'s own command line with this module imported first, which registers the model), or
from Python: ``lm_eval.simple_evaluate(model=ZayaLM("runs/tiny"), tasks=[...])``.

Requests are encoded as lm-eval's ``hf`` model encodes them (its ``TemplateLM``: the context's
trailing spaces moved to the continuation, an empty context scored after ``prefix_token_id``, the
tokenizer's BOS; the tokenizer's post-processor applied unless the text starts with its BOS), so
an export scored with ``--model hf`` gives the same numbers. Log-likelihoods are batched
(:mod:`zaya_jax.scoring.likelihood`: shared inputs read once, several requests to a row, the head
only where tokens are scored, rows split over the local devices); ``generate_until`` runs a task's
requests through the rollout engine at once (:mod:`zaya_jax.engine`), each with its own stops,
token budget and sampling. ``--apply_chat_template`` renders with the model's chat template (the
run's, as ``zaya convert zaya-to-hf`` exports it).

Several processes (``ZAYA_COORDINATOR`` / ``ZAYA_NUM_PROCESSES`` / ``ZAYA_PROCESS_ID``, or Slurm)
each score their share of every task; lm-eval gathers the results to rank 0, which writes them.
The exchange runs through ``jax.distributed``'s key-value store, not ``torch.distributed``.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from zaya_jax.engine import Request
from zaya_jax.lm import load
from zaya_jax.parallel import distributed
from zaya_jax.scoring.likelihood import LikelihoodScorer

_PIECE = 1 << 20  # characters per key-value entry when gathering objects between processes


@register_model("zaya")
class ZayaLM(TemplateLM):
    """``pretrained``: a run, checkpoint or HF directory; ``tokenizer``: override its tokenizer
    (a ``tokenizer.json`` path or ``byte``); ``max_length``: the longest scored sequence (default
    the model's ``max_position_embeddings``); ``batch_tokens``: tokens per loglikelihood forward
    pass (split over the local devices); ``slots``: ``generate_until`` requests in flight at once
    (the rollout engine's slots); ``seed``: of sampled generations."""

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        max_length: int | None = None,
        batch_tokens: int = 4096,
        slots: int = 64,
        seed: int = 0,
        **_: Any,
    ):
        super().__init__()
        distributed.initialize()  # a multi-process evaluation: before the model touches a device
        self._rank, self._world_size, self._device = jax.process_index(), jax.process_count(), "cpu"
        self.lm = load(pretrained, tokenizer)
        if self.lm.tokenizer is None:
            raise ValueError(f"{self.lm.tokenizer_problem}; pass model_args tokenizer=PATH")
        self.tok = self.lm.tokenizer
        self._max_length = int(max_length or self.lm.config.max_position_embeddings)
        self.slots, self.seed = int(slots), int(seed)
        self.scorer = LikelihoodScorer(self.lm.config, self.lm.variables, batch_tokens=int(batch_tokens))

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id  # the tokenizer's BOS (its EOS where it has none), as the hf model

    @property
    def tokenizer_name(self) -> str:
        spec = self.tok.spec
        return str(spec.get("path", spec.get("kind", "tokenizer"))).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any) -> list[int]:
        """As ``hf``: the tokenizer's post-processor applied (a BOS for many) unless told not to or
        the text already starts with the BOS (a chat template that writes it)."""
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tok.decode([self.prefix_token_id], False) or "\0")
        return [int(t) for t in self.tok.encode(string, add_special_tokens=add_special_tokens)]

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False, **_: Any):
        results = self.scorer.score([(context, tail) for _, context, tail in requests], self.max_length)
        out = []
        for (key, _, _), result in zip(requests, results, strict=True):
            out.append((result.logprob, result.greedy))
            self.cache_hook.add_partial("loglikelihood", key, out[-1])
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of ``max_length`` tokens (the first after
        ``prefix_token_id``), every window of every text scored in one batched call."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, tail in map(make_disjoint_window, rolling):
                windows.append((list(context), list(tail)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, result in zip(owners, self.scorer.score(windows, self.max_length), strict=True):
            totals[index] += result.logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Every request at once through the rollout engine (``slots`` in flight, continuous
        batching), each with its own ``until`` strings (the text returned ends before the first),
        ``max_gen_toks`` and sampling (``do_sample`` / ``temperature`` / ``top_p`` / ``top_k``, as
        lm-eval normalizes them; greedy by default); all stop at the model's EOS ids. A context too
        long for ``max_gen_toks`` more tokens keeps its end."""
        jobs = []
        for index, request in enumerate(requests):
            context, options = request.args
            kwargs = normalize_gen_kwargs(options, 256)
            until = tuple(s for s in kwargs["until"] if s)
            new = kwargs["max_gen_toks"]
            keep = max(1, self.max_length - new)
            prompt = (self.tok_encode(context) if context else [self.prefix_token_id])[-keep:]
            sample = bool(kwargs["do_sample"])
            jobs.append(
                Request(
                    prompt,
                    new,
                    (float(kwargs.get("temperature") or 1.0)) if sample else 0.0,
                    top_k=int(kwargs.get("top_k") or 0) if sample else 0,
                    top_p=float(kwargs.get("top_p") or 1.0) if sample else 1.0,
                    seed=self.seed,
                    stream=index,
                    stop_tokens=tuple(self.lm.stop_token_ids),
                    stop_strings=until,
                )
            )
        out = []
        for job, result in zip(jobs, self.lm.engine(slots=self.slots).run(jobs), strict=True):
            text = self.tok.decode([t for t in result.tokens.tolist() if t not in job.stop_tokens])
            cuts = [text.find(stop) for stop in job.stop_strings if stop in text]
            out.append(text[: min(cuts)] if cuts else text)
            self.cache_hook.add_partial("generate_until", requests[len(out) - 1].args, out[-1])
        return out

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The model's chat template (``--apply_chat_template``); a clear error where it has none."""
        if chat_template is False or chat_template is None:
            return None
        if self.lm.chat_template is None:
            raise ValueError(
                "--apply_chat_template needs a chat template, and this model's tokenizer has none; put "
                "chat_template.jinja beside its tokenizer.json (or a chat_template in tokenizer_config.json)"
            )
        return self.lm.chat_template.source

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """``chat_history`` rendered with the model's chat template as ``transformers``'
        ``apply_chat_template`` renders it (a template that rejects a system message is given the
        history without it, as the ``hf`` model does)."""
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        def render(history):
            texts, _ = render_jinja_template(
                [history],
                chat_template=self.chat_template(True),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
                **self.tok.template_variables(),
            )
            return texts[0]

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([m for m in chat_history if m["role"] != "system"])

    # Several processes: lm-eval's hooks, through jax.distributed's key-value store.
    def all_gather(self, tensor):
        import torch

        values = distributed.gather_strings(
            "lm_eval all_gather", json.dumps(tensor.cpu().reshape(-1).tolist())
        )
        return torch.tensor([v for value in values for v in json.loads(value)])

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """``obj`` of every process on ``dst`` (lm-eval's samples and metrics: JSON-like data
        with tuples, tuple keys and numpy scalars; never pickled), in rank order."""
        data = json.dumps(_tagged(obj), default=str)
        pieces = [data[i : i + _PIECE] for i in range(0, len(data), _PIECE)] or [""]
        counts = [int(n) for n in distributed.gather_strings("lm_eval pieces", str(len(pieces)))]
        gathered = [""] * self.world_size
        for i in range(max(counts)):
            piece = pieces[i] if i < len(pieces) else ""
            for rank, value in enumerate(distributed.gather_strings("lm_eval gather_object", piece)):
                gathered[rank] += value
        if self.rank != dst:
            return None
        return [_untagged(json.loads(value)) for value in gathered]

    def barrier(self) -> None:
        distributed.barrier("lm_eval")


def _tagged(obj: Any) -> Any:
    """``obj`` as JSON can hold it: tuples and dicts with other keys than strings tagged, numpy
    scalars as Python's (what :func:`_untagged` turns back)."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_tagged(x) for x in obj]}
    if isinstance(obj, list):
        return [_tagged(x) for x in obj]
    if isinstance(obj, dict):
        return {"__items__": [[_tagged(k), _tagged(v)] for k, v in obj.items()]}
    return obj


def _untagged(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_untagged(x) for x in obj]
    if isinstance(obj, dict) and "__tuple__" in obj:
        return tuple(_untagged(x) for x in obj["__tuple__"])
    if isinstance(obj, dict) and "__items__" in obj:
        return {_untagged(k): _untagged(v) for k, v in obj["__items__"]}
    return obj


def main() -> None:
    """``lm_eval``'s command line with the ``zaya`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
