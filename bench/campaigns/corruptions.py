"""What the damaged-input campaign does to post-training inputs beyond damaging their bytes: one
record of a JSONL file made wrong as a user or a broken export would write it (a cut line, a
missing or empty field, a value of an impossible type or range, a pair whose completions are the
same, a rollout whose ids leave the vocabulary), and a reward module rewritten into one that fails
as user code does (at import, when called, or by returning what is not a reward). Used by
``bench/campaigns/damage.py``; every damage is seeded by the case."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

# --- one record of a JSONL file --------------------------------------------------------------------

Record = dict[str, Any]


def _messages(record: Record) -> list[dict[str, Any]]:
    return record["messages"] if isinstance(record.get("messages"), list) else []


def _set_role(record: Record, rng: random.Random) -> Record:
    messages = [dict(m) for m in _messages(record)]
    messages[rng.randrange(len(messages))]["role"] = "wizard"
    return {**record, "messages": messages}


def _set_content(value: Any) -> Callable[[Record, random.Random], Record]:
    def change(record: Record, rng: random.Random) -> Record:
        messages = [dict(m) for m in _messages(record)]
        messages[rng.randrange(len(messages))]["content"] = value
        return {**record, "messages": messages}

    return change


def _only_user(record: Record, rng: random.Random) -> Record:
    return {**record, "messages": [m for m in _messages(record) if m.get("role") == "user"]}


def _identical(record: Record, rng: random.Random) -> Record:
    return {**record, "rejected": record["chosen"]}


def _prompt_ends_with_assistant(record: Record, rng: random.Random) -> Record:
    prompt = [{"role": "user", "content": str(record["prompt"])}, {"role": "assistant", "content": "ok"}]
    return {**record, "prompt": prompt}


def _field(name: str, value: Any) -> Callable[[Record, random.Random], Record]:
    return lambda record, rng: {**record, name: value}


def _list_item(name: str, value: Any) -> Callable[[Record, random.Random], Record]:
    def change(record: Record, rng: random.Random) -> Record:
        items = list(record[name])
        items[rng.randrange(len(items))] = value
        return {**record, name: items}

    return change


def _shorter(name: str) -> Callable[[Record, random.Random], Record]:
    return lambda record, rng: {**record, name: list(record[name])[:-1]}


def _without(name: str) -> Callable[[Record, random.Random], Record]:
    return lambda record, rng: {k: v for k, v in record.items() if k != name}


# Damage name -> how one record changes, per kind of record.
CHAT_RECORD = {
    "bad_role": _set_role,
    "content_not_string": _set_content(5),
    "content_empty": _set_content(""),
    "content_huge": _set_content("x" * 40_000),
    "messages_empty": _field("messages", []),
    "messages_missing": _without("messages"),
    "no_assistant_turn": _only_user,
}
PAIR_RECORD = {
    "identical_completions": _identical,
    "chosen_empty": _field("chosen", ""),
    "chosen_missing": _without("chosen"),
    "rejected_not_string": _field("rejected", ["a", "b"]),
    "prompt_missing": _without("prompt"),
    "prompt_ends_with_assistant": _prompt_ends_with_assistant,
    "pair_too_long": _field("chosen", "z" * 600),
}
ROLLOUT_RECORD = {
    "id_outside_vocabulary": _list_item("completion_ids", 10**6),
    "id_negative": _list_item("prompt_ids", -3),
    "id_not_integer": _list_item("completion_ids", 2.5),
    "logprob_nan": _list_item("logprobs", float("nan")),
    "logprob_positive": _list_item("logprobs", 3.0),
    "logprobs_shorter": _shorter("logprobs"),
    "reward_nan": _field("reward", float("nan")),
    "reward_string": _field("reward", "good"),
    "reward_missing": _without("reward"),
    "completion_empty": _field("completion_ids", []),
    "group_missing": _without("group"),
}
# Whole-file damages every JSONL kind gets: a cut line, a line that is not an object, bytes that
# are not UTF-8, a byte-order mark, blank lines between records, every record made too long.
LINE_DAMAGE = ("line_cut", "line_not_object", "invalid_utf8", "byte_order_mark", "blank_lines")


def damage_record_file(path: Path, damage: str, changes: dict[str, Callable], rng: random.Random) -> None:
    """Apply one record or line damage to the JSONL file at ``path`` (a seeded record)."""
    lines = path.read_text().splitlines()
    i = rng.randrange(len(lines))
    if damage in changes:
        lines[i] = json.dumps(changes[damage](json.loads(lines[i]), rng))
    elif damage == "line_cut":
        lines[i] = lines[i][: len(lines[i]) // 2]
    elif damage == "line_not_object":
        lines[i] = "[1, 2, 3]"
    elif damage == "blank_lines":
        lines = [x for line in lines for x in (line, "")]
    elif damage in ("invalid_utf8", "byte_order_mark"):
        data = [line.encode() for line in lines]
        if damage == "invalid_utf8":
            data[i] = data[i][:5] + b"\xff\xfe" + data[i][5:]
        else:
            data[0] = b"\xef\xbb\xbf" + data[0]
        path.write_bytes(b"\n".join(data) + b"\n")
        return
    else:
        raise ValueError(f"unknown record damage {damage!r}")
    path.write_text("\n".join(lines) + "\n")


# --- a reward module -------------------------------------------------------------------------------

REWARD_FUNCTION = "score"
GOOD_REWARD = f'''"""A reward: how many characters of the completion are ASCII letters."""


def {REWARD_FUNCTION}(record, completion):
    return float(sum(c.isalpha() for c in completion))
'''

_BODY = "def score(record, completion):\n    {}\n"
REWARD_MODULES = {
    "raises_at_import": "raise RuntimeError('the reward server is down')\n" + GOOD_REWARD,
    "syntax_error": GOOD_REWARD.replace("return float(", "return float((", 1),
    "imports_missing_package": "import zaya_no_such_package_xyz\n" + GOOD_REWARD,
    "function_missing": GOOD_REWARD.replace("def score(", "def scored(", 1),
    "not_callable": "score = 3.5\n",
    "wrong_arity": "def score(completion):\n    return 1.0\n",
    "raises": _BODY.format("raise KeyError('answer')"),
    "returns_none": _BODY.format("return None"),
    "returns_string": _BODY.format("return 'good'"),
    "returns_nan": _BODY.format("return float('nan')"),
    "returns_inf": _BODY.format("return float('-inf')"),
    "returns_list": _BODY.format("return [1.0, 2.0]"),
    "exits": _BODY.format("import sys; sys.exit(3)"),
    "returns_bool": _BODY.format("return completion.startswith('a')"),
    "returns_numpy": "import numpy as np\n\n" + _BODY.format("return np.float32(len(completion))"),
}


def damage_reward_module(path: Path, damage: str) -> None:
    path.write_text(REWARD_MODULES[damage])
