"""Passkey retrieval, the synthetic long-context check (Mohtashami & Jaggi's landmark-attention
format): a five-digit pass key hidden at a chosen depth of repeated filler text, asked for at the
end. A model that uses its whole context answers at any depth; one whose positions stop at the
length it was trained on does not, which is what a context extension is meant to change.

- :func:`passkey_text`: one document (text), the format the ``passkey`` data source trains on;
- :func:`passkey_documents`: that source's documents (``data.sources`` kind ``passkey``): 8,192
  documents of 96 to 1,024 characters (log-uniform), each its key at a uniform depth and its own
  filler sentence of random words (:func:`random_filler`: a fixed filler is learnt by heart, while
  one that changes with every document is predicted by copying from earlier in the context, the
  skill retrieval takes);
- :func:`passkey_prompt`: one check of exactly ``length`` tokens in token space, its answer's
  tokens last (:mod:`zaya_jax.eval.long_context` scores it).

The prompt is built from the pieces' token ids (intro, filler cut to length, needle, filler,
question, answer), so its length is exact with any tokenizer; with the byte tokenizer the ids are
those of :func:`passkey_text`'s text, byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

INTRO = "Remember the key.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
_WORD_LINE = (
    "grass green sky blue sun yellow here we go there and back again the a of to in is it you that he was "
    "for on are with as his they be at one have this from or had by hot word but what some we can out other "
    "were all there when up use your how said an each she which do their time if will way about many then "
    "them write would like so these her long make thing see him two has look more day could go come did"
)
WORDS = _WORD_LINE.split()  # the fillers' words
QUESTION = "What is the pass key? The pass key is "
DOCUMENTS = 8192  # in the passkey source
SHORTEST, LONGEST = 96, 1024  # characters of a passkey source document


def needle(key: str) -> str:
    return f"The pass key is {key}.\n"


def random_key(rng: np.random.Generator) -> str:
    return str(int(rng.integers(10_000, 100_000)))


def random_filler(rng: np.random.Generator) -> str:
    """A sentence of 6 to 12 random words: a document repeats it as its filler, so a model learns
    to copy from earlier in its context (what retrieving the key takes) on every repetition."""
    words = rng.choice(WORDS, size=int(rng.integers(6, 13)))
    return " ".join(words).capitalize() + ".\n"


def passkey_text(length: int, depth: float, key: str, filler_text: str = FILLER) -> str:
    """A document of about ``length`` characters (at least its fixed parts) hiding ``key`` after
    ``depth`` (0 to 1) of its filler (``filler_text`` repeated), asking for it at the end and
    answering."""
    fixed = len(INTRO) + len(needle(key)) + len(QUESTION) + len(key) + 1
    filler = max(length - fixed, 0)
    before = round(filler * depth)
    text = filler_text * (filler // len(filler_text) + 1)
    return INTRO + text[:before] + needle(key) + text[: filler - before] + QUESTION + key + "."


def passkey_documents(count: int = DOCUMENTS, seed: int = 0) -> Iterator[tuple[str, str]]:
    """(key, text) of the ``passkey`` source: ``count`` documents, lengths log-uniform in
    [SHORTEST, LONGEST] characters, depths uniform, keys random (all from ``seed``)."""
    rng = np.random.default_rng([seed, 0x9A55])
    for i in range(count):
        length = int(np.exp(rng.uniform(np.log(SHORTEST), np.log(LONGEST))))
        depth, key = float(rng.uniform()), random_key(rng)
        yield f"passkey/{i:05d}", passkey_text(length, depth, key, random_filler(rng))


def passkey_prompt(
    tokenizer: Any, length: int, depth: float, key: str, filler_text: str = FILLER
) -> tuple[np.ndarray, int]:
    """(ids, answer tokens): a check of exactly ``length`` tokens (``tokenizer``: a
    :class:`zaya_jax.data.tokenizers.Tokenizer`, not imported here: it imports the sources, which
    import this module) whose last ``answer tokens`` ids
    are the key, hidden after ``depth`` (0 to 1) of the filler (``filler_text`` repeated). Raises
    ``ValueError`` when ``length`` cannot hold the fixed parts."""
    intro, question = tokenizer.encode(INTRO), tokenizer.encode(QUESTION)
    hidden, answer = tokenizer.encode(needle(key)), tokenizer.encode(key)
    filler = length - len(intro) - len(hidden) - len(question) - len(answer)
    if filler < 0:
        raise ValueError(f"a passkey check needs at least {length - filler} tokens; give a longer length")
    unit = tokenizer.encode(filler_text)
    text = np.tile(np.asarray(unit, np.int64), filler // len(unit) + 1)
    before = round(filler * depth)
    ids = np.concatenate([intro, text[:before], hidden, text[: filler - before], question, answer])
    return ids.astype(np.int32), len(answer)
