"""Tokenizers: a download-free byte tokenizer and a wrapper around a local Hugging Face tokenizer.json.

Both expose the same small interface (:class:`Tokenizer`): ``encode``/``encode_batch`` to int32
arrays, ``decode``, the special ids ``pad_id``/``eos_id``/``bos_id``, ``vocab_size`` and ``spec``,
a JSON-able description stored in prepared-data manifests so that tokens are never read with a
different tokenizer than the one that wrote them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from zaya_jax.data.sources import DataError
from zaya_jax.files import read_json, sha256_file

# Byte tokenizer layout (also the `tiny` preset's pad/eos/bos ids).
BYTE_PAD_ID = 0
BYTE_EOS_ID = 1
BYTE_BOS_ID = 2
BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET

# Special tokens looked up, in order, when an HF tokenizer.json does not name them explicitly.
_EOS_CANDIDATES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|end|>", "[SEP]", "<EOS>")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<PAD>", "<|padding|>")
_BOS_CANDIDATES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<BOS>")
# The special tokens transformers passes to chat templates (its ``special_tokens_map``).
_TEMPLATE_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Texts per call into the Rust tokenizer: large enough to use its threads, small enough to bound memory.
_HF_ENCODE_BATCH = 1024


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    pad_id: int
    eos_id: int
    bos_id: int
    vocab_size: int

    @property
    def spec(self) -> dict[str, Any]: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def encode_concatenated(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]: ...

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]: ...

    def template_variables(self) -> dict[str, str]: ...

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0/1/2 = pad/eos/bos, byte ``b`` -> id ``b + 3`` (vocab 259)."""

    pad_id = BYTE_PAD_ID
    eos_id = BYTE_EOS_ID
    bos_id = BYTE_BOS_ID
    vocab_size = BYTE_VOCAB_SIZE

    @property
    def spec(self) -> dict[str, Any]:
        return {"kind": "byte", "vocab_size": self.vocab_size}

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """``text`` -> (num_bytes,) int32 ids, without special tokens (the byte tokenizer has no
        post-processor: ``add_special_tokens`` changes nothing)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text -> (num_bytes,) int32 ids; one buffer for the whole batch, split into views."""
        encoded = [t.encode("utf-8") for t in texts]
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
        bounds = np.cumsum([len(b) for b in encoded])[:-1]
        return np.split(flat, bounds) if encoded else []

    def encode_concatenated(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All texts as one (total,) uint16 id array and their (len(texts),) int64 lengths: a corpus
        in one pass, without a per-document int32 copy (the stdlib is ~30 M bytes)."""
        encoded = [t.encode("utf-8") for t in texts]
        ids = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(token_dtype(self.vocab_size))
        ids += BYTE_OFFSET
        return ids, np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``text`` -> ((n,) int32 ids, (n, 2) character spans): byte ``j`` spans its character."""
        lengths = np.fromiter((len(c.encode("utf-8")) for c in text), dtype=np.int64, count=len(text))
        chars = np.repeat(np.arange(len(text), dtype=np.int64), lengths)
        return self.encode(text), np.stack([chars, chars + 1], axis=1)

    def template_variables(self) -> dict[str, str]:
        """No special-token strings: the byte vocabulary's special ids have no text."""
        return {}

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Ids -> text; special ids (which have no text, so ``skip_special_tokens`` changes nothing)
        and ids past the byte range (padded model vocabularies) are dropped, invalid UTF-8 (e.g. a
        sampled partial character) becomes U+FFFD."""
        arr = _id_array(ids)
        arr = arr[(arr >= BYTE_OFFSET) & (arr < BYTE_VOCAB_SIZE)]
        return (arr - BYTE_OFFSET).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _id_array(ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """Any iterable of ids (list, generator, array of any shape) -> flat int64 array."""
    if not isinstance(ids, np.ndarray):
        ids = np.fromiter(ids, dtype=np.int64)
    return ids.astype(np.int64, copy=False).reshape(-1)


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` (never downloads).

    ``eos_token``/``pad_token``/``bos_token`` name the special tokens (a token string or an id);
    left out, the usual names (``<eos>``, ``</s>``, ``<|endoftext|>`` ...) are looked up. A tokenizer
    without a padding token pads with EOS (padding is masked out of the loss), one without a BOS
    token uses EOS as BOS (the GPT-2 convention).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        eos_token: str | int | None = None,
        pad_token: str | int | None = None,
        bos_token: str | int | None = None,
    ):
        from tokenizers import Tokenizer as _HFTokenizer

        given = Path(path).expanduser()
        self.path = given.resolve()
        if not self.path.is_file():
            state = "is a broken link" if given.is_symlink() else "does not exist"
            raise DataError(
                f"tokenizer file {given} {state}; set data.tokenizer to a local tokenizer.json or to 'byte'"
            )
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as err:  # the Rust library raises plain Exception on a malformed file
            raise DataError(
                f"{given} is not a valid Hugging Face tokenizer.json ({' '.join(str(err).split())}); "
                "restore it, or point data.tokenizer (--tokenizer) at the tokenizer.json of the model"
            ) from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._special_id(eos_token, _EOS_CANDIDATES, "eos_token")
        self.pad_id = self._special_id(pad_token, _PAD_CANDIDATES, "pad_token", fallback=self.eos_id)
        self.bos_id = self._special_id(bos_token, _BOS_CANDIDATES, "bos_token", fallback=self.eos_id)
        self._sha256 = sha256_file(self.path)

    def _special_id(
        self, given: str | int | None, candidates: Sequence[str], arg: str, fallback: int | None = None
    ) -> int:
        if isinstance(given, int):
            if not 0 <= given < self.vocab_size:
                raise DataError(
                    f"{arg}={given} is outside the vocabulary of {self.path} (size {self.vocab_size})"
                )
            return given
        if given is not None:
            token_id = self._tok.token_to_id(given)
            if token_id is None:
                raise DataError(f"{arg}={given!r} is not a token of {self.path}; pass a token it contains")
            return int(token_id)
        for name in candidates:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        if fallback is not None:
            return fallback
        raise DataError(
            f"{self.path} has none of the usual end-of-sequence tokens {list(candidates)}; "
            f"pass {arg}=... (the token that ends a document) to HFTokenizer"
        )

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def spec(self) -> dict[str, Any]:
        return {
            "kind": "hf",
            "path": str(self.path),
            "sha256": self._sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "bos_id": self.bos_id,
        }

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """``text`` -> (num_tokens,) int32 ids, without the post-processor's special tokens (the
        pipeline appends EOS itself) unless ``add_special_tokens`` (as ``transformers`` encodes by
        default: lm-eval's ``hf`` model, a BOS for many tokenizers)."""
        encoding = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return np.asarray(encoding.ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text -> (num_tokens,) int32 ids; the Rust library tokenizes the batch in parallel."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def encode_concatenated(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All texts as one (total,) id array of the narrowest dtype and their (len(texts),) lengths."""
        dtype = token_dtype(self.vocab_size)
        chunks, lengths = [], []
        for i in range(0, len(texts), _HF_ENCODE_BATCH):
            for ids in self.encode_batch(texts[i : i + _HF_ENCODE_BATCH]):
                chunks.append(ids.astype(dtype))
                lengths.append(ids.size)
        ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
        return ids, np.asarray(lengths, dtype=np.int64)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``text`` -> ((n,) int32 ids, (n, 2) character spans of ``text``), no special tokens added."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int32), offsets

    def template_variables(self) -> dict[str, str]:
        """The special-token strings a chat template sees (``bos_token``, ``eos_token`` ...), as
        ``transformers`` passes them: from ``special_tokens_map.json`` and ``tokenizer_config.json``
        beside the file (the latter wins), else, with neither file there, this tokenizer's own EOS
        and BOS tokens."""
        found = special_tokens(self.path.parent)
        if not found:
            for key, token_id in (("eos_token", self.eos_id), ("bos_token", self.bos_id)):
                token = self.id_to_token(token_id)
                if token is not None:
                    found[key] = token
        return found

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Ids -> text, special tokens skipped (``skip_special_tokens=False``: kept as their text,
        ``<|im_end|>``, as a chat template renders them)."""
        return self._tok.decode(_id_array(ids).tolist(), skip_special_tokens=skip_special_tokens)


def special_tokens(directory: str | Path) -> dict[str, str]:
    """The special-token strings (``bos_token``, ``eos_token``, ``pad_token`` ...) that a tokenizer
    directory's ``special_tokens_map.json`` and ``tokenizer_config.json`` name, with transformers'
    precedence (the latter wins); {} when it has neither. A file that cannot be read is an error
    naming it."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        config = Path(directory) / name
        if not os.path.lexists(config):
            continue
        fix = "restore it, or remove it to use the tokenizer's defaults"
        settings = read_json(config, "the tokenizer's settings", fix)
        for key in _TEMPLATE_TOKEN_KEYS:
            value = settings.get(key)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


def load_tokenizer(spec: str | Path) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; anything else is the path of a local tokenizer.json."""
    if str(spec) == "byte":
        return ByteTokenizer()
    if str(spec) == "none":
        raise DataError(
            "the model has no tokenizer (converted from a Hugging Face directory without tokenizer.json); "
            "give the one it was trained with: --tokenizer PATH, or data.tokenizer=PATH to train"
        )
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"tokenizer {str(spec)!r}: no such file {path.resolve()}; set data.tokenizer to 'byte' "
            "or to the path of a local tokenizer.json (nothing is downloaded)"
        )
    return HFTokenizer(path)


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``spec`` dicts produce the same ids: the file's location does not matter, its
    contents (sha256) and the special ids do."""
    return {k: v for k, v in a.items() if k != "path"} == {k: v for k, v in b.items() if k != "path"}


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding every id: uint16 when all ids fit in 16 bits."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)
