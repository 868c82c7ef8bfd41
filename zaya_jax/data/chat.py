"""Chat conversations rendered with a chat template into tokens and an assistant-only loss mask.

A chat record is one JSON object per line of a JSONL file (``.gz``/``.zst`` too) with a ``messages``
list in the OpenAI / Hugging Face format, ``{"role": ..., "content": "..."}`` with the roles
``system``, ``user``, ``assistant`` and ``tool`` (an assistant message may carry ``tool_calls``
instead of content; other keys are passed to the template as they are), and optionally ``tools``
(a list of JSON schemas).

Rendering calls ``transformers``' own renderer (``render_jinja_template``: its sandboxed Jinja
environment, extensions and variables, the special-token strings passed the way
``apply_chat_template`` passes them) rather than a copy of it, so a template renders here exactly
as ``tokenizer.apply_chat_template`` renders it; the rendered text is then tokenized in one piece
without added special tokens, as ``apply_chat_template(tokenize=True)`` does. ``transformers`` is
only imported here, for chat data.

The trained tokens (the loss mask):

- a template with ``{% generation %}`` blocks: the tokens overlapping the characters the blocks
  produced, the rule of ``return_assistant_tokens_mask``;
- a template without them: each assistant message's span found by rendering message prefixes, the
  text ``messages[:i + 1]`` adds to ``messages[:i]`` rendered with the generation prompt. A template
  whose prefixes do not render as prefixes of the whole (one that rewrites earlier turns) is
  refused with that explanation: give it ``{% generation %}`` blocks.

Templates come from the source's ``chat_template`` file (``zaya data prepare --chat-template``),
else ``chat_template.jinja`` beside ``tokenizer.json``, else ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of named templates: ``default``). The byte
tokenizer has the built-in :data:`BYTE_CHAT_TEMPLATE`.

A chat document is a (2, n) integer array: row 0 the token ids, row 1 the mask (1 = trained). The
packer (:mod:`zaya_jax.data.packing`) turns the mask into the rows' ``loss_mask`` and cuts a
conversation longer than a row after an assistant turn where it can.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zaya_jax.config import Config, DataSource
from zaya_jax.data.sources import BadDocuments, DataError, iter_records, resolve_files
from zaya_jax.data.tokenizers import Tokenizer
from zaya_jax.files import read_json

ROLES = ("system", "user", "assistant", "tool")
# The byte tokenizer's template: each message as ``<|role|>\n`` + content + ``<|end|>\n``, the
# assistant's content, tool calls and closing marker inside the generation block (so the model learns
# to end its turn), the tools (if any) first as JSON, and ``<|assistant|>\n`` as the generation prompt.
BYTE_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>\n"
    "{% if message.role == 'assistant' %}{% generation %}{{ message.content or '' }}"
    "{% if message.tool_calls %}<|tool_calls|>{{ message.tool_calls | tojson }}{% endif %}"
    "<|end|>\n{% endgeneration %}"
    "{% else %}{{ message.content }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
FIX_RECORD = 'write one {"messages": [{"role": ..., "content": "..."}, ...]} object per line'


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and where it came from (named in errors and in the manifest)."""

    source: str
    origin: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def has_generation_blocks(self) -> bool:
        return bool(_GENERATION_TAG.search(self.source))


def _read_template_file(path: Path) -> ChatTemplate:
    try:
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(
            f"cannot read the chat template {path} ({err}); give a readable UTF-8 Jinja file"
        ) from None


def find_chat_template(tokenizer_spec: str, template_file: str | None = None) -> ChatTemplate:
    """The chat template for ``tokenizer_spec`` (``"byte"`` or a tokenizer.json path): the given
    ``template_file``, else the tokenizer's own (see the module doc)."""
    if template_file:
        path = Path(template_file).expanduser()
        if not path.is_file():
            raise DataError(f"chat template {path} does not exist; give the path of a Jinja template file")
        return _read_template_file(path)
    if str(tokenizer_spec) == "byte":
        return ChatTemplate(BYTE_CHAT_TEMPLATE, "the byte tokenizer's built-in template")
    tokenizer_path = Path(tokenizer_spec).expanduser()
    directory = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    beside = directory / "chat_template.jinja"
    if beside.is_file():
        return _read_template_file(beside)
    config = directory / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
            raise DataError(f"cannot read {config} ({err}); fix it or give --chat-template FILE") from None
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return ChatTemplate(template, f"{config} (chat_template)")
    raise DataError(
        f"the tokenizer {tokenizer_spec} has no chat template (looked for {beside} and a chat_template in "
        f"{config}); give one with --chat-template FILE (or the source's chat_template)"
    )


def _renderer() -> tuple[Callable[..., Any], Callable[..., Any]]:
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template
    except ImportError:
        raise DataError(
            "chat data is rendered with transformers' chat-template renderer: pip install transformers "
            "(or the zaya-jax[chat] extra)"
        ) from None
    return render_jinja_template, _compile_jinja_template


def check_record(record: dict[str, Any]) -> str | None:
    """What is wrong with a chat record, or None when it can be rendered and trained on."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        fields = ", ".join(map(repr, record)) or "none"
        return f"no non-empty 'messages' list (fields: {fields})"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is a {type(message).__name__}, not an object"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}] has role {role!r}; use one of {', '.join(ROLES)}"
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            continue
        if not isinstance(content, str):
            return f"messages[{i}] ({role}) has {type(content).__name__} content, not a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing in it would be trained"
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "'tools' is not a list of JSON schemas (objects)"
    return None


class ChatEncoder:
    """Renders chat records with ``template`` and tokenizes them with ``tokenizer`` into (2, n)
    documents (ids; 1 on the trained tokens)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate):
        self.tokenizer = tokenizer
        self.template = template
        self._render, compile_template = _renderer()
        import jinja2

        try:
            compile_template(template.source)
        except jinja2.TemplateError as err:
            raise DataError(f"the chat template {template.origin} does not compile: {err}") from None
        self._variables = tokenizer.template_variables()
        self._template_errors = (jinja2.TemplateError, TypeError, ValueError)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its trained (assistant) parts."""
        if self.template.has_generation_blocks:
            texts, spans = self._render(
                [messages],
                tools=tools,
                chat_template=self.template.source,
                return_assistant_tokens_mask=True,
                **self._variables,
            )
            return texts[0], [tuple(span) for span in spans[0]]
        return self._render_by_prefixes(messages, tools)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """``messages`` rendered with the generation prompt: the text a model continues to reply."""
        return self._text(messages, tools, prompt=True)

    def turn_end_ids(self) -> tuple[int, ...]:
        """The token that closes an assistant turn in this template: the first token rendered after
        an assistant message's content, when it is a special token (one with no text of its own, as
        ChatML's ``<|im_end|>`` or Llama 3's ``<|eot_id|>``); () when the turn ends in plain text
        (the byte template's ``<|end|>`` bytes) or the template cannot render a plain exchange."""
        sentinel = "Zq"
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}]
        try:
            text = self._text(messages, None)
        except self._template_errors:
            return ()
        end = text.rfind(sentinel) + len(sentinel)
        ids, offsets = self.tokenizer.encode_offsets(text)
        after = np.flatnonzero((offsets[:, 0] >= end) & (offsets[:, 1] > offsets[:, 0]))
        if end < len(sentinel) or not len(after):
            return ()
        first = int(ids[after[0]])
        return (first,) if self.tokenizer.decode([first]) == "" else ()

    def _text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, prompt: bool = False
    ) -> str:
        texts, _ = self._render(
            [messages],
            tools=tools,
            chat_template=self.template.source,
            add_generation_prompt=prompt,
            **self._variables,
        )
        return texts[0]

    def _render_by_prefixes(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[str, list[tuple[int, int]]]:
        text = self._text(messages, tools)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._text(messages[:i], tools, prompt=True) if i else ""
            through = self._text(messages[: i + 1], tools)
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"the template {self.template.origin} does not render messages[:{i + 1}] as a prefix of "
                    "the whole conversation, so the assistant turns cannot be found by rendering prefixes; "
                    "mark them with {% generation %} ... {% endgeneration %} in the template"
                )
            spans.append((len(before), len(through)))
        return text, spans

    def encode_record(self, record: dict[str, Any]) -> np.ndarray:
        """Any record -> (2, n) document; ValueError naming what is wrong with it."""
        problem = check_record(record)
        if problem is not None:
            raise ValueError(problem)
        return self.encode(record)

    def encode(self, record: dict[str, Any], last_turns: int | None = None) -> np.ndarray:
        """A checked record (see :func:`check_record`) -> (2, n) int32 [ids; trained]: every
        assistant turn trained, or only the last ``last_turns`` (a preference completion). Raises
        ValueError when the template rejects it or trains none of its tokens."""
        try:
            text, spans = self.render(record["messages"], record.get("tools"))
        except self._template_errors as err:
            raise ValueError(f"the chat template {self.template.origin} rejects it: {err}") from None
        if last_turns is not None:
            spans = spans[len(spans) - last_turns :]
        ids, offsets = self.tokenizer.encode_offsets(text)
        trained = np.zeros(len(ids), dtype=np.int32)
        for start, end in spans:  # every token overlapping a span, as return_assistant_tokens_mask
            trained |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
        if not trained.any():
            raise ValueError(f"the chat template {self.template.origin} renders no assistant token for it")
        return np.stack([ids.astype(np.int32), trained])


@dataclasses.dataclass(frozen=True)
class ChatDocuments:
    """Encoded conversations of one source: ``keys[i]`` names ``documents[i]`` ((2, n) arrays)."""

    keys: list[str]
    documents: list[np.ndarray]
    skipped: int


def iter_encoded(
    source: DataSource, encode: Callable[[dict[str, Any]], np.ndarray], bad: BadDocuments, fix: str, noun: str
) -> Iterator[tuple[str, np.ndarray]]:
    """(key, ``encode(record)``) for every record of the JSONL ``source``; a record ``encode``
    refuses (ValueError: what is wrong) goes to ``bad`` (raise, or skip and count) with the file,
    line and ``fix``; none left at all is an error."""
    count = 0
    for item in encode_records(iter_records(resolve_files(source), bad), encode, bad, fix):
        count += 1
        yield item
    if count == 0:
        raise DataError(no_records_message(source, bad, noun))


def encode_records(
    records: Iterator[tuple[str, str, dict[str, Any]]],
    encode: Callable[[dict[str, Any]], np.ndarray],
    bad: BadDocuments,
    fix: str = "",
) -> Iterator[tuple[str, np.ndarray]]:
    """(key, ``encode(record)``) of JSONL ``records``; refused records go to ``bad``."""
    for key, where, record in records:
        try:
            document = encode(record)
        except ValueError as err:
            bad.report(f"{where}: {err}", fix or FIX_RECORD)
            continue
        yield key, document


def no_records_message(source: DataSource, bad: BadDocuments, noun: str = "conversations") -> str:
    """Why a chat or preference ``source`` is refused when none of its records could be used."""
    detail = f"; the first problem: {bad.problems[0]}" if bad.problems else ""
    return f"{source.kind} source {source.name!r} ({source.path}) has no {noun}{detail}"


def read_encoded(
    source: DataSource,
    encode: Callable[[dict[str, Any]], np.ndarray],
    on_bad_document: str,
    fix: str,
    noun: str,
) -> ChatDocuments:
    """Every record of ``source`` encoded (see :func:`iter_encoded`), with the count skipped."""
    bad = BadDocuments(on_bad_document)  # type: ignore[arg-type]
    keys, documents = [], []
    for key, document in iter_encoded(source, encode, bad, fix, noun):
        keys.append(key)
        documents.append(document)
    return ChatDocuments(keys, documents, bad.count)


def iter_chat_documents(
    source: DataSource, encoder: ChatEncoder, bad: BadDocuments
) -> Iterator[tuple[str, np.ndarray]]:
    """(key, (2, n) document) for every conversation of the chat ``source``; bad records go to
    ``bad`` (raise, or skip and count) with the file, line and fix."""
    return iter_encoded(source, encoder.encode_record, bad, FIX_RECORD, "conversations")


def read_chat_documents(source: DataSource, tokenizer: Tokenizer, on_bad_document: str) -> ChatDocuments:
    """Every conversation of the chat ``source``, encoded (see :func:`iter_chat_documents`)."""
    encoder = ChatEncoder(tokenizer, find_chat_template_for(source, tokenizer))
    return read_encoded(source, encoder.encode_record, on_bad_document, FIX_RECORD, "conversations")


def find_chat_template_for(source: DataSource, tokenizer: Tokenizer) -> ChatTemplate:
    """The template of a chat source: its own ``chat_template`` file or its tokenizer's."""
    return tokenizer_chat_template(tokenizer, source.chat_template)


def tokenizer_chat_template(tokenizer: Tokenizer, template_file: str | None = None) -> ChatTemplate:
    """``template_file``'s template, else the loaded ``tokenizer``'s own (see :func:`find_chat_template`)."""
    spec = tokenizer.spec
    return find_chat_template("byte" if spec["kind"] == "byte" else spec["path"], template_file)


def generation_config_eos(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ``eos_token_id`` (an id or a list) of ``generation_config.json`` beside an HF
    tokenizer's file, () when there is none."""
    if tokenizer.spec["kind"] != "hf":
        return ()
    path = Path(tokenizer.spec["path"]).parent / "generation_config.json"
    if not path.is_file():
        return ()
    eos = read_json(path, "the generation config", "fix it or remove it").get("eos_token_id")
    listed = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(isinstance(t, int) and 0 <= t < tokenizer.vocab_size for t in listed):
        raise DataError(f"{path}: eos_token_id {eos!r} is not a token id of the tokenizer or a list of them")
    return tuple(listed)


def stop_ids(model_stops: Sequence[int], tokenizer: Tokenizer, chat: ChatEncoder | None) -> tuple[int, ...]:
    """Every id a model's sampling stops on, each once: ``model_stops`` (the model config's
    ``stop_token_ids``), the tokenizer's EOS, the EOS list of ``generation_config.json`` beside
    the tokenizer, and ``chat``'s end of turn (:meth:`ChatEncoder.turn_end_ids`) where it has a
    template. What rollouts stop on and what ``zaya convert zaya-to-hf`` lists in ``eos_token_id``."""
    ids = (
        *model_stops,
        tokenizer.eos_id,
        *generation_config_eos(tokenizer),
        *(chat.turn_end_ids() if chat else ()),
    )
    return tuple(dict.fromkeys(int(i) for i in ids))


def rollout_stop_ids(cfg: Config, tokenizer: Tokenizer, chat: ChatEncoder | None = None) -> tuple[int, ...]:
    """The ids a rollout (and the held-out reward's greedy completion) stops on (:func:`stop_ids`
    with the tokenizer's chat template, when ``chat`` is not given): the chat template's end of
    turn (``<|im_end|>`` for ChatML) included, so a chat model stops where its reply ends without
    ``model.eos_token_ids`` set by hand."""
    chat = chat or ChatEncoder(tokenizer, tokenizer_chat_template(tokenizer))
    return stop_ids(cfg.model.stop_token_ids, tokenizer, chat)
