"""The damaged-input campaign's cases: which inputs, which damage, which command, and how an outcome
is judged. Run by ``bench/campaigns/damage_runner.py`` (the fixtures, a worker process that runs
the cases, a parent that catches hangs); the CI runs a seeded subset
(``tests/resilience/test_damaged_inputs.py``), ``bench/damaged_inputs.py`` the full campaign.

**Inputs** (:data:`KINDS`), each a fixture copied fresh for every case: a run directory (a 4-step
run saved at steps 2 and 4) given as the run or as its step directory ``checkpoints/4``; a Hugging
Face ``save_pretrained`` directory (one safetensors file, a BPE ``tokenizer.json`` and its
``tokenizer_config.json``) and a sharded one (an index file); a ``zaya data prepare`` directory; the
JSONL corpus it was prepared from; a YAML config; dotted overrides. Targets inside them are named by
kind of file: the step items, Orbax's metadata (``_CHECKPOINT_METADATA``, ``_METADATA``,
``_sharding``, ``array_metadatas``), OCDBT files (manifests, data files), fingerprints, configs,
safetensors headers and index files, tokenizers, manifests and shards; ``every:`` damages that
target in every step (nothing readable left).

**Damage** (:func:`apply_damage`, seeded per case): deleted, emptied, truncated, random bytes, a
symlink to garbage outside the input or a dangling one, no read permission (root reads it anyway: the
case then shows what an unaffected command does), wrong JSON/YAML types at a random place, a path
in an index or manifest pointing outside its directory (at a real file there), a directory emptied
or holding only a stray file, a new empty step directory or one holding only a stray file.

**Outcomes** (:func:`judge`): ``fallback`` (exit 0 after a line saying a step was set aside),
``unaffected`` (exit 0, the damage did not matter to this command), ``clear`` (exit 1 or 2, the last
line of stderr one line naming the damaged path or a directory holding it, and no traceback),
``unclear`` (such an exit without naming it), ``traceback`` (an exception escaped the command; for
the Python API, an exception other than the documented ones; or a traceback printed on stderr, by a
library or when the command's leftovers are collected), ``hang`` (no result within the
timeout; decided by the runner) and, besides, ``modified``: a file or directory the user had (after
the damage) is gone or changed, other than a step moved whole into ``<run>/quarantine/``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import yaml

from bench.campaigns.corruptions import (
    CHAT_RECORD,
    LINE_DAMAGE,
    PAIR_RECORD,
    REWARD_MODULES,
    ROLLOUT_RECORD,
    damage_record_file,
    damage_reward_module,
)

STEP = "checkpoints/4"
ORBAX_ITEM_FILES = ("_METADATA", "_sharding", "manifest.ocdbt", "array_metadatas/process_0")
OCDBT_FILES = ("ocdbt.process_0/manifest.ocdbt", "ocdbt.process_0/d/*", "d/*")

# A target: (pattern relative to the input's copy, type). Types: file, json, yaml, jsonl, index and
# manifest (JSON naming other files), dir, newdir (created by the damage).
_STEP_TARGETS = (
    (f"{STEP}/_CHECKPOINT_METADATA", "json"),
    (f"{STEP}/commit_success.txt", "file"),
    (f"{STEP}/config/metadata", "json"),
    (f"{STEP}/fingerprints/metadata", "json"),
    *(
        (f"{STEP}/{item}/{name}", "json" if "META" in name else "file")
        for item in ("params", "balancing")
        for name in ORBAX_ITEM_FILES
    ),
    *((f"{STEP}/{item}/{name}", "file") for item in ("params", "balancing") for name in OCDBT_FILES),
    *((f"{STEP}/{item}", "dir") for item in ("params", "balancing", "config", "fingerprints")),
    (STEP, "dir"),
)
_RUN_TARGETS = (
    *_STEP_TARGETS,
    ("config.yaml", "yaml"),
    ("metrics.jsonl", "jsonl"),
    ("events.jsonl", "jsonl"),
    ("summary.json", "json"),
    ("checkpoints/9", "newdir"),
    ("every:checkpoints/*/params", "dir"),
    ("every:checkpoints/*/config/metadata", "json"),
    ("every:checkpoints/*/params/manifest.ocdbt", "file"),
    ("checkpoints", "dir"),
)
_HF_TARGETS = (("config.json", "json"), ("model.safetensors", "file"), ("generation_config.json", "json"))
_SHARDED_TARGETS = (
    ("model.safetensors.index.json", "index"),
    ("model-*.safetensors", "file"),
    ("config.json", "json"),
)


@dataclasses.dataclass(frozen=True)
class Kind:
    """An input: the fixture copied for each case (relative to the fixtures), what the command is
    given (relative to the copy), where the damage goes, and the commands that read it; ``names``:
    words that name the input in an error besides its path (a config key); ``post_training``:
    the input belongs to the post-training campaign (its own table)."""

    name: str
    source: str
    given: str
    targets: tuple[tuple[str, str], ...]
    commands: tuple[str, ...]
    names: tuple[str, ...] = ()
    post_training: bool = False


KINDS = {
    k.name: k
    for k in (
        Kind(
            "run",
            "run",
            "",
            _RUN_TARGETS,
            ("eval", "generate", "inspect", "to_hf", "load", "harness", "init_from", "resume"),
        ),
        Kind(
            "step", "run", STEP, _STEP_TARGETS, ("eval", "generate", "inspect", "to_hf", "load", "init_from")
        ),
        Kind("hf", "hf", "", _HF_TARGETS, ("to_zaya", "inspect", "eval", "generate", "load", "init_from")),
        Kind(
            "hf_sharded",
            "hf_sharded",
            "",
            _SHARDED_TARGETS,
            ("to_zaya", "inspect", "eval", "load", "init_from"),
        ),
        Kind(
            "tokenizer",
            "hf",
            "",
            (("tokenizer.json", "json"), ("tokenizer_config.json", "json")),
            ("eval", "generate", "load", "harness", "prepare_with"),
        ),
        Kind(
            "prepared",
            "prepared",
            "",
            (("manifest.json", "manifest"), ("shard-*.array_record", "file"), ("", "dir")),
            ("inspect_rows", "train_on"),
        ),
        Kind("corpus", "corpus.jsonl", "", (("", "jsonl"),), ("prepare",)),
        Kind("config", "config.yaml", "", (("", "yaml"),), ("train_config", "inspect_config")),
        Kind(
            "overrides",
            "",
            "",
            tuple((text, "override") for text in ()),
            ("train_override", "inspect_override"),
        ),
    )
}

# Overrides as a user mistypes them; the message must name the key (or the text).
OVERRIDES = (
    "model.num_layers=abc",
    "model.num_layer=2",
    "modle.hidden_size=32",
    "model.num_layers",
    "data.sources=[{",
    "train.steps=-3",
    "run.name=../escape",
    "optim.lr=[1, 2]",
    "model.hidden_size={a: 1}",
    "train.batch_size=",
    "=3",
    "model..x=1",
    "data.sources=[{kind: nope, path: x}]",
    "checkpoint.keep=0",
    "model.num_experts=0",
    "train.seq_len=1e400",
)
KINDS["overrides"] = dataclasses.replace(
    KINDS["overrides"], targets=tuple((text, "override") for text in OVERRIDES)
)

# --- post-training inputs: chat and preference sources, GRPO prompts, rollout files, reward modules,
# a dpo and a simpo run (reference scores, checkpoints, logs), the rl and preference keys.
RL_OVERRIDES = (
    "rl.temperature=.nan",
    "rl.temperature=-1",
    "rl.group_size=0",
    "rl.group_size=3",
    "rl.max_new_tokens=0",
    "rl.max_new_tokens=100000",
    "rl.kl=-0.5",
    "rl.clip_high=.inf",
    "rl.clip_low=2",
    "rl.reward=zaya_no_such_module:score",
    "rl.reward=no_colon_here",
    "rl.reward=math:pi",
    "rl.reward=os:getcwd",
    "rl.on_reward_error=maybe",
    "rl.eval_prompts=-1",
    "rl.prompts=/no/such/prompts.jsonl",
    "rl.rollouts=/no/such/rollouts.jsonl",
    "rl.steps_per_rollout=0",
    "train.objective=ppo",
)
PREFERENCE_OVERRIDES = (
    "preference.beta=0",
    "preference.beta=.nan",
    "preference.beta=abc",
    "preference.beta=-1",
    "preference.simpo_gamma=.inf",
    "preference.simpo_gamma=[1]",
    "train.objective=dpo_typo",
    "data.sources=[{name: p, kind: preference, path: /no/such/pairs.jsonl}]",
)
_RUN_FILES = (
    ("config.yaml", "yaml"),
    ("events.jsonl", "jsonl"),
    ("metrics.jsonl", "jsonl"),
    ("checkpoints/2/params/d/*", "file"),
    ("checkpoints/2/config/metadata", "json"),
    ("checkpoints/2", "dir"),
    ("checkpoints", "dir"),
)
_REWARD = "zr_reward.py"
POST_TRAINING_KINDS = (
    Kind("chat", "chat.jsonl", "", (("", "chat"),), ("sft", "sft_skip", "prepare_chat"), post_training=True),
    Kind("pairs", "pairs.jsonl", "", (("", "pairs"),), ("dpo", "simpo", "eval_pairs"), post_training=True),
    Kind("prompts", "prompts.jsonl", "", (("", "chat"),), ("grpo_prompts",), post_training=True),
    Kind("rollouts", "rollouts.jsonl", "", (("", "rollouts"),), ("grpo_rollouts",), post_training=True),
    Kind(
        "reward",
        "reward",
        "",
        ((_REWARD, "module"),),
        ("grpo", "grpo_skip", "eval_grpo"),
        names=("rl.reward",),
        post_training=True,
    ),
    Kind(
        "dpo_run",
        "dpo_run",
        "",
        (
            ("reference/logps.npz", "file"),
            ("reference/manifest.json", "json"),
            ("reference", "dir"),
            *_RUN_FILES,
        ),
        ("resume_dpo", "eval", "eval_pairs_of_run"),
        post_training=True,
    ),
    Kind("simpo_run", "simpo_run", "", _RUN_FILES, ("resume_simpo", "eval"), post_training=True),
    Kind(
        "rl_overrides",
        "",
        "",
        tuple((text, "override") for text in RL_OVERRIDES),
        ("grpo_override",),
        post_training=True,
    ),
    Kind(
        "preference_overrides",
        "",
        "",
        tuple((text, "override") for text in PREFERENCE_OVERRIDES),
        ("dpo_override", "simpo_override"),
        post_training=True,
    ),
)
KINDS.update({k.name: k for k in POST_TRAINING_KINDS})
PRETRAINING = tuple(name for name, kind in KINDS.items() if not kind.post_training)
POST_TRAINING = tuple(kind.name for kind in POST_TRAINING_KINDS)
OVERRIDE_KINDS = ("overrides", "rl_overrides", "preference_overrides")

_FILE_DAMAGE = (
    "deleted",
    "emptied",
    "truncated",
    "random_bytes",
    "symlink_outside",
    "symlink_dangling",
    "unreadable",
)
DAMAGE = {
    "file": _FILE_DAMAGE,
    "json": (*_FILE_DAMAGE, "wrong_type"),
    "yaml": (*_FILE_DAMAGE, "wrong_type"),
    "jsonl": (*_FILE_DAMAGE, "wrong_type"),
    "index": (*_FILE_DAMAGE, "wrong_type", "outside_path"),
    "manifest": (*_FILE_DAMAGE, "wrong_type", "outside_path"),
    "dir": ("deleted", "emptied", "stray_file", "symlink_dangling", "unreadable"),
    "newdir": ("created_empty", "created_with_stray_file"),
    "override": ("given",),
    "chat": (*_FILE_DAMAGE, "wrong_type", *LINE_DAMAGE, *CHAT_RECORD),
    "pairs": (*_FILE_DAMAGE, "wrong_type", *LINE_DAMAGE, *PAIR_RECORD),
    "rollouts": (*_FILE_DAMAGE, "wrong_type", *LINE_DAMAGE, *ROLLOUT_RECORD),
    "module": (*_FILE_DAMAGE, *REWARD_MODULES),
}
_RECORD_CHANGES = {"chat": CHAT_RECORD, "pairs": PAIR_RECORD, "rollouts": ROLLOUT_RECORD}


@dataclasses.dataclass(frozen=True)
class Case:
    index: int
    kind: str
    target: str
    damage: str
    command: str
    seed: int

    def describe(self) -> str:
        return f"#{self.index} {self.kind}:{self.target or '.'} {self.damage} -> {self.command}"


def plan(seed: int, count: int, kinds: tuple[str, ...] | None = None) -> list[Case]:
    """``count`` distinct cases, drawn round-robin over the input kinds (default: the pretraining
    ones; a kind whose combinations are used up drops out), each a seeded choice of target,
    damage and command."""
    rng = random.Random(seed)
    pools = {}
    for name in kinds or PRETRAINING:
        kind = KINDS[name]
        combos = [(t, d, c) for t, typ in kind.targets for d in DAMAGE[typ] for c in kind.commands]
        rng.shuffle(combos)
        pools[name] = combos
    cases: list[Case] = []
    while len(cases) < count and any(pools.values()):
        for name, pool in pools.items():
            if pool and len(cases) < count:
                target, damage, command = pool.pop()
                cases.append(Case(len(cases), name, target, damage, command, rng.randrange(2**31)))
    return cases


# --- applying damage -------------------------------------------------------------------------------


def _wrong_type(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """``value`` with one element, at a random depth, replaced by a value of another type."""
    if isinstance(value, dict) and value and depth < 3 and rng.random() < 0.75:
        key = rng.choice(sorted(value))
        return {**value, key: _wrong_type(value[key], rng, depth + 1)}
    if isinstance(value, list) and value and depth < 3 and rng.random() < 0.5:
        i = rng.randrange(len(value))
        return [*value[:i], _wrong_type(value[i], rng, depth + 1), *value[i + 1 :]]
    if isinstance(value, dict):
        return [1, 2]
    if isinstance(value, list):
        return {"x": 1}
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, str):
        return 12345
    if isinstance(value, int | float):
        return "not a number"
    return {"x": []}


def _rewrite_wrong_type(path: Path, typ: str, rng: random.Random) -> None:
    if typ in ("jsonl", *_RECORD_CHANGES):
        lines = path.read_text().splitlines()
        i = rng.randrange(len(lines))
        lines[i] = json.dumps(_wrong_type(json.loads(lines[i]), rng))
        path.write_text("\n".join(lines) + "\n")
    elif typ == "yaml":
        path.write_text(yaml.safe_dump(_wrong_type(yaml.safe_load(path.read_text()), rng)))
    else:
        path.write_text(json.dumps(_wrong_type(json.loads(path.read_text()), rng)))


def _point_outside(path: Path, typ: str, case_dir: Path) -> None:
    """An index or manifest entry naming a real file outside its directory (copied there)."""
    data = json.loads(path.read_text())
    outside = case_dir / "outside"
    outside.mkdir(exist_ok=True)
    if typ == "index":
        name = sorted(data["weight_map"])[0]
        source = path.parent / data["weight_map"][name]
        shutil.copy(source, outside / source.name)
        data["weight_map"] = {
            k: f"../outside/{source.name}" if v == source.name else v for k, v in data["weight_map"].items()
        }
    else:
        shard = data["shards"][0]
        shutil.copy(path.parent / shard["file"], outside / shard["file"])
        shard["file"] = f"../outside/{shard['file']}"
    path.write_text(json.dumps(data, indent=2))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def targets_of(copy: Path, target: str, rng: random.Random) -> list[Path]:
    """The paths a target names in the input's copy: one seeded match of its pattern, or every match
    for ``every:`` targets."""
    every = target.startswith("every:")
    pattern = target.removeprefix("every:")
    if not pattern:
        return [copy]
    if "*" not in pattern:
        return [copy / pattern]
    matches = sorted(copy.glob(pattern))
    assert matches, f"{pattern} matches nothing in {copy}"
    return matches if every else [rng.choice(matches)]


def apply_damage(case: Case, copy: Path, case_dir: Path, garbage: Path) -> list[Path]:
    """Damage the case's target(s) in ``copy``; returns the damaged paths."""
    rng = random.Random(case.seed)
    typ = dict(KINDS[case.kind].targets)[case.target]
    paths = targets_of(copy, case.target, rng)
    for path in paths:
        _damage_one(path, case.damage, typ, rng, case_dir, garbage)
    return paths


def _damage_one(path: Path, damage: str, typ: str, rng: random.Random, case_dir: Path, garbage: Path) -> None:
    if damage == "deleted":
        _remove(path)
    elif damage == "emptied":
        if path.is_dir():
            for child in path.iterdir():
                _remove(child)
        else:
            path.write_bytes(b"")
    elif damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "random_bytes":
        path.write_bytes(rng.randbytes(max(16, path.stat().st_size)))
    elif damage in ("symlink_outside", "symlink_dangling"):
        _remove(path)
        path.symlink_to(garbage if damage == "symlink_outside" else case_dir / "no-such-file")
    elif damage == "unreadable":
        path.chmod(0)
    elif damage == "wrong_type":
        _rewrite_wrong_type(path, typ, rng)
    elif damage == "outside_path":
        _point_outside(path, typ, case_dir)
    elif typ in _RECORD_CHANGES:
        damage_record_file(path, damage, _RECORD_CHANGES[typ], rng)
    elif typ == "module":
        damage_reward_module(path, damage)
    elif damage in ("stray_file", "created_empty", "created_with_stray_file"):
        if path.exists():
            shutil.rmtree(path)
        path.mkdir()
        if damage != "created_empty":
            (path / "stray.txt").write_text("left here by someone\n")
    else:
        raise ValueError(f"unknown damage {damage!r}")


def restore_permissions(root: Path) -> None:
    """Make every entry readable again (``unreadable`` cases), so the copy can be hashed and removed."""
    for entry in [root, *root.rglob("*")] if root.exists() else []:
        if not entry.is_symlink():
            entry.chmod(
                entry.stat().st_mode | stat.S_IRUSR | stat.S_IWUSR | (stat.S_IXUSR if entry.is_dir() else 0)
            )


# --- judging ---------------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (``root`` itself as ``.``): directories, symlinks (their target,
    not followed) and files (mode and sha256), keyed by path relative to ``root``."""
    entries: dict[str, tuple] = {}
    if not root.exists() and not root.is_symlink():
        return entries
    stack = [root]
    while stack:
        path = stack.pop()
        rel = "." if path == root else str(path.relative_to(root))
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            entries[rel] = ("link", os.readlink(path))
        elif stat.S_ISDIR(info.st_mode):
            entries[rel] = ("dir", stat.S_IMODE(info.st_mode))
            stack.extend(path.iterdir()) if os.access(path, os.R_OK | os.X_OK) else None
        else:
            digest = (
                hashlib.sha256(path.read_bytes()).hexdigest() if os.access(path, os.R_OK) else "unreadable"
            )
            entries[rel] = ("file", stat.S_IMODE(info.st_mode), digest)
    return entries


def lost_entries(before: dict[str, tuple], after: dict[str, tuple], training: bool) -> list[str]:
    """What the user had that is gone or changed: each entry of ``before`` must be in ``after``
    unchanged, or (for a step) moved whole to ``quarantine/<step>-<time>/``, and nothing new may
    appear outside ``quarantine/``. A resumed training run (``training``) writes its logs, config
    and new steps by design: there only ``checkpoints/`` entries it had are checked."""
    quarantined: dict[str, list[str]] = {}
    for rel in after:
        parts = rel.split("/")
        if parts[0] == "quarantine" and len(parts) > 1:
            quarantined.setdefault(parts[1].split("-")[0], []).append(rel)
    lost = []
    for rel, sig in before.items():
        parts = rel.split("/")
        if after.get(rel) == sig or (training and parts[0] != "checkpoints"):
            continue
        if len(parts) >= 2 and parts[0] == "checkpoints":
            inside = ["/".join(q.split("/")[2:]) for q in quarantined.get(parts[1], [])]
            rest = "/".join(parts[2:])
            if rest in inside and any(
                after[q] == sig or rest == ""
                for q in quarantined[parts[1]]
                if "/".join(q.split("/")[2:]) == rest
            ):
                continue
        lost.append(rel)
    if not training:
        lost += [f"new: {rel}" for rel in after if rel not in before and not rel.startswith("quarantine")]
    return lost


def names_path(message: str, damaged: list[Path], given: Path, given_is_whole_input: bool) -> bool:
    """Whether ``message`` names a damaged path or a directory holding one inside what the command
    was given (the step directory it was given counts; a whole run or HF directory does not)."""
    for path in damaged:
        for candidate in (path, *path.parents):
            inside = given in candidate.parents or (candidate == given and not given_is_whole_input)
            if (candidate == path or inside) and str(candidate) in message:
                return True
    return False


@dataclasses.dataclass
class Outcome:
    case: Case
    result: str  # fallback | unaffected | clear | unclear | traceback | hang
    modified: list[str]
    exit_code: int | None
    message: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "case": dataclasses.asdict(self.case)}


def is_fallback(line: str) -> bool:
    """A documented fallback: a step set aside, lost reference scores computed again from the
    starting weights, a reward function's failure skipped by ``rl.on_reward_error: skip``."""
    return (
        ("quarantine" in line and "cannot be used" in line)
        or "computing the reference log-probabilities again" in line
        or "rl.on_reward_error=skip" in line
    )


def judge(
    case: Case,
    exit_code: int | None,
    stderr: str,
    line: str,
    escaped: str | None,
    damaged: list[Path],
    given: Path,
) -> tuple[str, str]:
    """(result, the line it is judged on); see the module docstring. ``line`` is the command's error
    line (the last ``zaya CMD:`` line that is not a warning)."""
    if escaped is not None:
        return "traceback", escaped.strip().splitlines()[-1] if escaped.strip() else "?"
    if "Traceback (most recent call last)" in stderr:  # printed by a library, or at exit
        return "traceback", stderr[stderr.index("Traceback (most recent call last)") :][:1500]
    if exit_code == 0:
        fallback = [x for x in stderr.splitlines() if is_fallback(x)]
        return ("fallback", fallback[-1]) if fallback else ("unaffected", "")
    if exit_code in (1, 2):
        kind = KINDS[case.kind]
        if any(word in line for word in kind.names):
            named = True
        elif case.kind in OVERRIDE_KINDS:
            key = case.target.split("=")[0]
            parts = [f"'{part}'" for part in key.split(".") if part]
            paths = re.findall(r"/[\w./-]+", case.target)  # a path the override gives
            named = bool(key and key in line) or case.target in line or any(p in line for p in parts + paths)
        else:
            named = names_path(line, damaged, given, not kind.given)
        return ("clear" if named else "unclear"), line
    return "unclear", f"exit {exit_code}: {line}"
