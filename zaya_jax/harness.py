"""lm-evaluation-harness integration (the ``[eval]`` extra): an ``lm_eval`` model named ``zaya``.

``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` run on :func:`zaya_jax.load`
(a run, a checkpoint or an HF directory), so a run is scored with the harness without exporting it::

    python -m zaya_jax.harness run --model zaya --model_args pretrained=runs/tiny --tasks TASKS

(``lm_eval``'s own command line with this module imported first, which registers the model), or
from Python: ``lm_eval.simple_evaluate(model=ZayaLM("runs/tiny"), tasks=[...])``.

Scored sequences are left-padded to the next power of two (at least 16 tokens), so a task compiles
a handful of programs, not one per request length; ``generate_until`` runs all of a task's
requests through the rollout engine at once (:mod:`zaya_jax.engine`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from zaya_jax.engine import Request
from zaya_jax.lm import load


def _bucket(length: int) -> int:
    return max(16, 1 << (length - 1).bit_length())


@register_model("zaya")
class ZayaLM(LM):
    """``pretrained``: a run, checkpoint or HF directory; ``tokenizer``: override its tokenizer
    (a ``tokenizer.json`` path or ``byte``); ``max_length``: the longest scored sequence (default
    the model's ``max_position_embeddings``); ``slots``: ``generate_until`` requests in flight at
    once (the rollout engine's slots)."""

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        max_length: int | None = None,
        slots: int = 64,
        **_: Any,
    ):
        super().__init__()
        self.lm = load(pretrained, tokenizer)
        if self.lm.tokenizer is None:
            raise ValueError(f"{self.lm.tokenizer_problem}; pass model_args tokenizer=PATH")
        self.tok = self.lm.tokenizer
        self.max_length = int(max_length or self.lm.config.max_position_embeddings)
        self.slots = int(slots)

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text)]

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log p(continuation | context) and whether greedy decoding gives the continuation."""
        ids = (context + continuation)[-(self.max_length + 1) :]
        inputs, targets = ids[:-1], ids[1:]
        width = _bucket(len(inputs))
        padded = np.full((1, width), self.lm.config.pad_token_id, np.int32)
        padded[0, width - len(inputs) :] = inputs
        mask = (np.arange(width) >= width - len(inputs))[None].astype(np.int32)
        logits = self.lm.logits(padded, attention_mask=mask)[0, width - len(continuation) :]
        logits = logits - logits.max(-1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        wanted = np.asarray(targets[-len(continuation) :])
        score = float(logprobs[np.arange(len(wanted)), wanted].sum())
        return score, bool(np.array_equal(logits.argmax(-1), wanted))

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            context, continuation = request.args
            spaces = len(context) - len(context.rstrip())  # a word's space belongs to the continuation
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = self._encode(context + continuation)
            head = self._encode(context) if context else [self.tok.eos_id]
            tail = whole[len(head) :] if context else whole
            out.append(self._score(head, tail))
        return out

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args
            windows = get_rolling_token_windows(
                token_list=self._encode(text),
                prefix_token=self.tok.eos_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            total = 0.0
            for window in map(make_disjoint_window, windows):
                total += self._score(list(window[0]), list(window[1]))[0]
            out.append(total)
        return out

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Every request at once through the rollout engine (``slots`` in flight, continuous
        batching): each stops at the model's EOS ids or at one of its ``until`` strings (the text
        returned ends before it); a context too long for ``max_gen_toks`` more tokens keeps its end."""
        jobs = []
        for index, request in enumerate(requests):
            context, options = request.args
            until = options.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(s for s in until if s)
            new = int(options.get("max_gen_toks", 256))
            sample = bool(options.get("do_sample", False))
            keep = max(1, min(self.max_length, self.lm.config.max_position_embeddings) - new)
            prompt = (self._encode(context) if context else [self.tok.eos_id])[-keep:]
            temperature = float(options.get("temperature", 1.0)) if sample else 0.0
            stops = tuple(self.lm.stop_token_ids)
            jobs.append(
                Request(prompt, new, temperature, stream=index, stop_tokens=stops, stop_strings=until)
            )
        out = []
        for job, result in zip(jobs, self.lm.engine(slots=self.slots).run(jobs), strict=True):
            text = self.tok.decode([t for t in result.tokens.tolist() if t not in job.stop_tokens])
            cuts = [text.find(stop) for stop in job.stop_strings if stop in text]
            out.append(text[: min(cuts)] if cuts else text)
        return out


def main() -> None:
    """``lm_eval``'s command line with the ``zaya`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
