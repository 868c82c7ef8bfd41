"""The README and the manual in ``docs/`` are checked like code, so they cannot rot as the code moves:
no history in them (commit ids, dates, issue numbers: those live in ``bench/RESULTS.md`` and the git
log), every ``zaya ...`` command line parses with the real parser, every ``section.key`` is a key of
the config schema, every relative link and ``#anchor`` resolves, the README stays a front door
(<= 300 lines, one link from it to every page), its test command is the one CI runs, and the site
builds with ``mkdocs build --strict`` (a broken link, anchor or page fails the build)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
import typing
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- reading Markdown: fenced blocks, prose, inline code spans ----

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: its info string (``bash``, ``python``, ...), first line and lines."""

    info: str
    line: int
    lines: tuple[str, ...]


@cache
def _split(path: Path) -> tuple[tuple[Block, ...], tuple[tuple[int, str], ...]]:
    """The file's fenced blocks, and its other lines as (line number, text)."""
    blocks, prose = [], []
    fence, info, start, body = None, "", 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence, info, start, body = match.group(1), match.group(2).strip(), number, []
        elif (
            fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip(fence[0])
        ):
            blocks.append(Block(info, start, tuple(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append((number, line))
    return tuple(blocks), tuple(prose)


def _paragraphs(path: Path) -> list[tuple[int, str]]:
    """Prose as paragraphs (blank-line separated, lines joined by spaces): a code span may wrap."""
    out, lines, first = [], [], 0
    for number, line in [*_split(path)[1], (0, "")]:
        if line.strip():
            first = first or number
            lines.append(line)
        elif lines:
            out.append((first, " ".join(lines)))
            lines, first = [], 0
    return out


_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")


def _spans(path: Path) -> list[tuple[int, str]]:
    """Inline code spans, with the line their paragraph starts on."""
    return [(n, m.group(2).strip()) for n, text in _paragraphs(path) for m in _SPAN.finditer(text)]


def _without_spans(text: str) -> str:
    return _SPAN.sub(" ", text)


# ---- 1. no history: commit ids, dates, issue numbers ----

_URL = re.compile(r"https?://[^\s)>\]]+")
# A word of 7-40 hex digits standing alone (not part of a path, file name, identifier or number such
# as 0x1f2e3d4c or 5000000.0), with at least one digit and one letter a-f (English words like
# "defaced" have no digit), or all digits (this manual writes large numbers with thousands
# separators, 1,048,576, so a bare run of 7+ digits is a commit id).
_HEX = re.compile(r"(?<![\w./\\-])([0-9a-f]{7,40})(?![\w/-])(?!\.\w)(?!,\d)")
_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_DATES = (
    re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),  # 2026-12-05
    re.compile(rf"\b{_MONTH}\.? \d{{1,2}}(?:st|nd|rd|th)?\b"),  # December 5, Dec 5th
    re.compile(rf"\b\d{{1,2}}(?:st|nd|rd|th)? {_MONTH}\b"),  # 5 December
    re.compile(rf"\b{_MONTH},? (?:19|20)\d\d\b"),  # December 2026
)
# This project's issues: "issue 41", "issues 40 and 41", "#41" and a link to "issues/41" or "pull/41".
# Another project's issue is cited as owner/repo#N (openxla/xla#47283) or by its full URL.
_ISSUE_WORD = re.compile(r"\b(?:issues?|PR|pull request) #?\d+", re.IGNORECASE)
_HASH_NUMBER = re.compile(r"#\d+(?![\w-])")
_OWNER_REPO = re.compile(r"[\w.-]+/[\w.-]+$")
_ISSUE_PATH = re.compile(r"\b(?:issues|pull)/\d+")


def _history(text: str, *, code: bool) -> list[str]:
    """What in ``text`` is a commit id, a date or an issue number (``code``: a fenced block's line,
    whose hex words are example output such as fingerprints, so only dates and issues count)."""
    found = []
    text = _URL.sub(" ", text)
    if not code:
        found += [f"commit id? {m.group(1)}" for m in _HEX.finditer(text) if _looks_like_commit(m.group(1))]
    found += [f"date {m.group(0)!r}" for pattern in _DATES for m in pattern.finditer(text)]
    found += [f"issue {m.group(0)!r}" for m in _ISSUE_WORD.finditer(text)]
    found += [
        f"issue {m.group(0)!r}"
        for m in _HASH_NUMBER.finditer(text)
        if not _OWNER_REPO.search(text[: m.start()])
    ]
    found += [f"issue link {m.group(0)!r}" for m in _ISSUE_PATH.finditer(text)]
    return found


def _looks_like_commit(word: str) -> bool:
    has_digit, has_letter = any(c.isdigit() for c in word), any(c in "abcdef" for c in word)
    return has_digit and (has_letter or len(word) >= 7)


def test_no_commit_ids_dates_or_issue_numbers():
    """Dated runs, commit ids and issue numbers belong in bench/RESULTS.md (which is exempt) and the
    git log; the manual states current behaviour. The rule: a standalone word of 7-40 hex digits with
    a digit and a letter, or of 7+ digits, outside fenced blocks (a fenced block may show example
    output: a fingerprint, a hex constant); a YYYY-MM-DD or month-name date; "issue N", "PR N", a
    "#N" not qualified by another project's owner/repo, an "issues/N" or "pull/N" link."""
    problems = []
    for path in _pages():
        for block in _split(path)[0]:
            for offset, line in enumerate(block.lines, 1):
                problems += [f"{_name(path)}:{block.line + offset}: {p}" for p in _history(line, code=True)]
        for number, line in _split(path)[1]:
            problems += [f"{_name(path)}:{number}: {p}" for p in _history(line, code=False)]
    assert not problems, "history in the docs (move it to bench/RESULTS.md):\n" + "\n".join(problems)


def test_the_history_rule_catches_what_it_should():
    assert _history("the clean-clone CI run at `ee518a7` took 24 min", code=False)
    assert _history("until 4707693 the plan compiled a step of its own", code=False)
    assert _history("measured 2026-12-05 on a 2-core VM", code=False)
    assert _history("on December 5, after the kernel", code=False)
    assert _history("as in issue 40", code=False) and _history("fixed in #41", code=False)
    assert _history("see ../../issues/41", code=False)
    for fine in (
        "rope_theta `5000000.0`, 27,922,084,064 bytes, 0x1f2e3d4c5b",
        "openxla/xla#47283 and NVIDIA/Megatron-LM#4168",
        "`custom_calls/cpu/cca_cpu.cc`, a file `4d46a1b2c.bin`, the word defaced",
        "[the default run](training.md#the-default-run), spec §2.4, May be",
    ):
        assert not _history(fine, code=False), fine
    assert not _history("train_step_fingerprint: 3f9a2c1d7e6b5a40", code=True)


# ---- 2. every zaya command line parses with the real parser ----

_LAUNCHERS = ("srun", "env", "taskset", "timeout", "time", "nohup", "exec")


def _shell_commands(line: str) -> list[list[str]]:
    """A shell line's simple commands (split at &&, ||, ;, |), comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in [*commands, current] if c]


def _zaya_argv(words: list[str]) -> list[str] | None:
    """The argv of ``zaya`` in a simple command, also under a launcher (``srun -n 2 zaya train``) or
    after environment assignments; None when the command is not zaya's, or the words are zaya's
    output (``zaya train: the train step ...``, ``zaya CMD: warning:``)."""
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        words = words[1:]
    if words and words[0] in _LAUNCHERS and "zaya" in words:
        words = words[words.index("zaya") :]
    if not words or words[0] != "zaya":
        return None
    if len(words) > 1 and words[1].endswith(":"):
        return None
    return words[1:]


def _command_lines(path: Path) -> list[tuple[int, str, bool]]:
    """Every command line, and whether it is whole: fenced shell lines (``\\`` continuations joined,
    a ``$ `` prompt dropped), whole; inline code spans that start with ``zaya ``, which may name a
    command without its arguments."""
    out = []
    for block in _split(path)[0]:
        if block.info.split()[:1] not in ([], ["bash"], ["sh"], ["shell"], ["console"]):
            continue
        pending, first = "", 0
        for offset, line in enumerate(block.lines, 1):
            first = first or block.line + offset
            pending += line.rstrip().removesuffix("\\") + " "
            if not line.rstrip().endswith("\\"):
                out.append((first, pending.strip().removeprefix("$ "), True))
                pending, first = "", 0
    out += [(n, span, False) for n, span in _spans(path) if span.startswith("zaya ")]
    return out


def _documented_commands() -> list[tuple[str, list[str], bool]]:
    found = []
    for path in _pages():
        for number, line, whole in _command_lines(path):
            try:
                commands = _shell_commands(line)
            except ValueError:  # unbalanced quotes: not a shell line (a table's cell, prose)
                continue
            for words in commands:
                argv = _zaya_argv(words)
                if argv is not None:
                    found.append((f"{_name(path)}:{number}", argv, whole))
    return found


@cache
def _parser(complete: bool):
    """``zaya``'s parser; with ``complete=False`` no argument is required, so a code span may name a
    command without its arguments (``zaya eval``) while every word it does show is still parsed."""
    from zaya_jax.cli.commands import build_parser

    parser = build_parser()
    if not complete:
        pending = [parser]
        while pending:
            for action in pending.pop()._actions:
                action.required = False
                if isinstance(action, argparse._SubParsersAction):
                    pending += list(action.choices.values())
    return parser


def _parse_error(argv: list[str], complete: bool = True) -> str | None:
    """None when ``zaya ARGV`` parses as the CLI parses it (argparse, the argv dialects, the
    positional config); else the parser's message. Nothing runs."""
    from zaya_jax.cli.argv import inspect_positionals, parse, positional_config
    from zaya_jax.config import ConfigError

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = parse(_parser(complete), argv)
            if args.subcommand == "inspect":
                inspect_positionals(args)
            positional_config(args)
    except SystemExit as exit_:
        return None if exit_.code == 0 else stderr.getvalue().strip().splitlines()[-1]
    except ConfigError as err:
        return str(err)
    if args.subcommand == "supervise" and getattr(args, "command", None):
        tail = [word for word in args.command if word != "--"]
        inner = _zaya_argv(tail)
        return None if inner is None else _parse_error(inner, complete)
    return None


def test_every_documented_zaya_command_parses():
    """Every ``zaya ...`` line of a shell block parses whole (placeholders such as RUN or PATH are
    fine as arguments); a code span may leave out required arguments (```zaya eval``` names the
    command), but every subcommand, option and value it shows must parse."""
    commands = _documented_commands()
    assert len(commands) > 50, "the command lines were not found"
    problems = [
        f"{where}: zaya {shlex.join(argv)}: {err}"
        for where, argv, whole in commands
        if (err := _parse_error(argv, complete=whole))
    ]
    assert not problems, "documented commands the CLI rejects:\n" + "\n".join(problems)


def test_the_command_check_rejects_a_wrong_command():
    assert _parse_error(["train", "small", "train.steps=10", "--init-from", "runs/x"]) is None
    assert _parse_error(["supervise", "--max-restarts", "5", "--", "zaya", "train"]) is None
    assert _parse_error(["trian"]) is not None
    assert _parse_error(["train", "--no-such-flag"]) is not None
    assert _parse_error(["generate", "runs/tiny", "--max-new-tokens", "N"]) is not None
    assert _parse_error(["eval"]) is not None and _parse_error(["eval"], complete=False) is None
    assert _parse_error(["eval", "--jsn"], complete=False) is not None
    assert _zaya_argv(["srun", "-n", "2", "zaya", "data", "prepare", "x"]) == ["data", "prepare", "x"]
    assert _zaya_argv(["zaya", "train:", "the", "train", "step"]) is None


# ---- 3. every section.key is a key of the config schema ----


@cache
def _config_keys() -> tuple[frozenset[str], frozenset[str]]:
    """The schema's sections and every key: ``section.key``, and ``section.key.field`` for a list of
    entries (``data.sources``, ``train.stages``, ``mesh.rules``); the moved keys still load."""
    from zaya_jax.config import Config
    from zaya_jax.config.loading import MOVED_KEYS

    sections, keys = set(), {".".join(old) for old in MOVED_KEYS}
    for section in dataclasses.fields(Config):
        sections.add(section.name)
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            keys.add(f"{section.name}.{field.name}")
            for item in typing.get_args(hints[field.name]):
                if dataclasses.is_dataclass(item):
                    keys |= {f"{section.name}.{field.name}.{sub.name}" for sub in dataclasses.fields(item)}
    return frozenset(sections), frozenset(keys)


# A dotted word (not part of a path, module or attribute chain: nothing of [\w./-] before it).
_DOTTED = re.compile(r"(?<![\w./\\-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?![\w-])(\()?")
_FILE_SUFFIXES = frozenset(
    {"py", "md", "json", "jsonl", "yaml", "yml", "txt", "sh", "cc", "cu", "h", "toml", "ipynb", "gz", "zst"}
    | {"safetensors", "html", "csv", "log", "bin", "so"}
)


def _named_keys(text: str) -> list[str]:
    """The config keys ``text`` names: dotted words whose first part is a config section, except
    file names (``train.py``, ``eval.jsonl``: a file suffix last), calls (``train.loop.train(``) and
    names of the package (``data.jsonl_records``: ``zaya_jax.data`` has it)."""
    sections, keys = _config_keys()
    out = []
    for match in _DOTTED.finditer(text):
        word, call = match.group(1), match.group(2)
        parts = word.split(".")
        if parts[0] not in sections or parts[-1] in _FILE_SUFFIXES or call:
            continue
        if word in keys or not _is_package_name(word):
            out.append(word)
    return out


@cache
def _is_package_name(word: str) -> bool:
    """``word`` is a module of ``zaya_jax`` or a name in one (``checkpoint.same_model_run``)."""
    import importlib

    module, _, name = word.rpartition(".")
    for candidate, attribute in ((word, None), (module, name)):
        try:
            found = importlib.import_module(f"zaya_jax.{candidate}")
        except ImportError:
            continue
        if attribute is None or hasattr(found, attribute):
            return True
    return False


def test_every_named_config_key_exists():
    """Every ``section.key`` (or ``section.key=value``) in prose, code spans and code blocks names a
    key of the schema (``zaya_jax/config/``); ``section.*`` and bare section names are not keys.
    ZAYA1_SPEC.md is left out: its dotted names are Hugging Face's module paths
    (``model.layers.0.self_attn``), not zaya-jax keys."""
    _, keys = _config_keys()
    problems = []
    for path in [p for p in _pages() if p.name != "ZAYA1_SPEC.md"]:
        lines = [*_split(path)[1]] + [
            (b.line + i, t) for b in _split(path)[0] for i, t in enumerate(b.lines, 1)
        ]
        for number, line in lines:
            problems += [f"{_name(path)}:{number}: {key}" for key in _named_keys(line) if key not in keys]
    assert not problems, "config keys the schema does not have:\n" + "\n".join(problems)


def test_the_key_check_tells_keys_from_other_dotted_words():
    _, keys = _config_keys()
    assert {"train.steps", "mesh.rules", "data.sources.kind", "train.log_every"} <= keys
    assert _named_keys("set `train.stepz=10` and model.num_layers=2") == ["train.stepz", "model.num_layers"]
    assert not _named_keys("cli/train.py, train.py, eval.jsonl, zaya_jax.train.train, train.loop.train(cfg)")
    assert not _named_keys("metrics.jsonl, config.yaml, e.g. a `model.*` override, run/name")
    assert not _named_keys("files through `data.jsonl_records`, `checkpoint.same_model_run`")


# ---- 4. every relative link resolves, anchors included ----

_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it (and the site: mkdocs.yml's toc slugify): the text
    without Markdown, lower case, every character but letters, digits, ``_``, ``-`` and spaces
    dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("**", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    out, seen = set(), {}
    for _, line in _split(path)[1]:
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def _links(path: Path) -> list[tuple[int, str]]:
    return [
        (number, m.group(1))
        for number, text in _paragraphs(path)
        for pattern in (_LINK, _HTML_LINK)
        for m in pattern.finditer(_without_spans(text))
    ]


def _link_problem(path: Path, target: str) -> str | None:
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return None
    file, _, anchor = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    if not resolved.exists():
        return "no such file"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"no heading with the anchor #{anchor} in {_name(resolved)}"
    return None


def test_every_relative_link_resolves():
    problems = [
        f"{_name(path)}:{number}: ({target}) {problem}"
        for path in [*_pages(), ROOT / "bench" / "RESULTS.md"]
        for number, target in _links(path)
        if (problem := _link_problem(path, target))
    ]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slugs_follow_github():
    assert slug("Post-training: SFT → DPO → GRPO on `tiny` (`bench/post_training.py`)") == (
        "post-training-sft--dpo--grpo-on-tiny-benchpost_trainingpy"
    )
    assert slug("ZeRO-1 (`mesh.optimizer_sharding=zero1`)") == "zero-1-meshoptimizer_shardingzero1"
    assert _link_problem(README, "docs/nowhere.md") and _link_problem(README, "docs/index.md#nowhere")


# ---- 5. the README: a front door ----


def test_readme_is_short_and_links_every_page():
    """A newcomer goes from the README to any page of the manual in one click (``docs/index.md`` is
    the README itself on the site)."""
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in _links(README)}
    pages = [page for page in sorted(DOCS.glob("*.md")) if page.name != "index.md"]  # the site's README
    missing = [_name(page) for page in pages if page.resolve() not in linked]
    assert not missing, f"pages the README does not link: {missing}"


def test_readme_test_command_is_what_ci_runs():
    """The README's second command is exactly what ``.ci/run`` runs (less CI's environment variable
    and pip's ``-q``)."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    ci_words = [w for w in shlex.split(ci) if w != "-q" and not re.fullmatch(r"[A-Z_]+=.*", w)]
    readme = [line for _, line, _ in _command_lines(README) if line.startswith('pip install -e ".[dev]"')]
    assert readme, "the README's test command is gone"
    assert [w for w in shlex.split(readme[0], comments=True) if w != "-q"] == ci_words


# ---- 6. the site builds with --strict ----


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict`` of ``mkdocs.yml``: a broken link or anchor, a page missing from the
    navigation or a docstring mkdocstrings cannot render fails it."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "api" / "index.html").exists()
