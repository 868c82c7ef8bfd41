"""Loading a config: YAML presets with inheritance, dotted overrides, typed conversion into the
schema (:class:`~zaya_jax.config.schema.Config` and its sections), and writing it back.

A config is built in three steps:

1. a preset (``configs/<name>.yaml`` or a path) is read with ``yaml.safe_load``; a top-level
   ``inherits: <name or path>`` key merges it over its parent, recursively;
2. dotted overrides (``model.num_layers=4``) are applied, values parsed as YAML scalars/lists;
3. the merged dict is converted into frozen dataclasses, checking every key and type, and the
   result is validated for impossible combinations.

Every problem raises :class:`ConfigError` with the offending key and what to change.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from zaya_jax.config.errors import ConfigError
from zaya_jax.config.model import ModelConfig
from zaya_jax.config.schema import Config
from zaya_jax.files import InputFileError, read_text_file, write_atomic

_INHERITS = "inherits"
_REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
_PACKAGED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def config_dirs() -> list[Path]:
    """Directories searched for bare preset names: the repository's ``configs/``, then the wheel's copy."""
    return [d for d in (_REPO_CONFIGS, _PACKAGED_CONFIGS) if d.is_dir()]


def available_presets() -> list[str]:
    return sorted({p.stem for d in config_dirs() for p in d.glob("*.yaml")})


def _preset_path(name_or_path: str | Path, relative_to: Path | None = None) -> Path:
    text = str(name_or_path)
    if text.endswith((".yaml", ".yml")) or "/" in text:
        path = Path(text)
        if not path.is_absolute() and relative_to is not None and not path.exists():
            path = relative_to / path
        if not path.is_file():
            raise ConfigError(f"config file {text!r} does not exist")
        return path
    for directory in config_dirs():
        candidate = directory / f"{text}.yaml"
        if candidate.is_file():
            return candidate
    close = difflib.get_close_matches(text, available_presets(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"unknown preset {text!r}; {hint}available presets: {', '.join(available_presets())}")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = read_text_file(path, "a config", "fix it or give another --config")
    except InputFileError as err:
        raise ConfigError(str(err)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if data is None:
        raise ConfigError(
            f"{path} is empty; a config holds sections (run:, model:, train: ...) and may inherit a preset"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return dict(_with_moved_keys(data, str(path)))


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _resolve_preset(name_or_path: str | Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    given = _preset_path(name_or_path, relative_to=seen[-1].parent if seen else None)
    path = given.resolve()
    if path in seen:
        chain = " -> ".join(str(p.name) for p in (*seen, path))
        raise ConfigError(f"config inheritance cycle: {chain}")
    data = _read_yaml(given)
    parent = data.pop(_INHERITS, None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: {_INHERITS} must be a preset name or a YAML path, got {parent!r}")
    try:
        base = _resolve_preset(parent, (*seen, path))
    except ConfigError as err:
        raise ConfigError(f"{path}: {_INHERITS}: {err}") from None
    return _deep_merge(base, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"model.num_layers=4"`` -> (["model", "num_layers"], 4); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. model.num_layers=4")
    keys = key.strip().split(".")
    if not all(part.strip() for part in keys):
        raise ConfigError(f"override {text!r}: the key {key!r} has an empty part; write section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: cannot parse value {raw!r}: {err}") from None
    return keys, value


def _apply_override(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override of {'.'.join(keys)}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert lists to tuples; raise ConfigError."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a section (mapping), got {value!r}")
        return _build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # X | None: X's own message
            return _coerce(value, options[0], key)
        for arg in options:
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {_type_name(tp)}")
    if origin is Literal:
        value = _renamed_value(key, value)
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {_type_name(tp)}")
        return value
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConfigError(f"{key}={value!r} must be a list")
        (item_tp, _) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, str | float) and not isinstance(value, bool):  # token counts as 1.2e13
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if number.is_integer():
                return int(number)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")


def _build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {full!r}{hint} (valid: {', '.join(names)})")
        kwargs[key] = _coerce(value, hints[key], full)
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in kwargs]
    if missing:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"{', '.join(where + name for name in missing)} must be given (no default)")
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a plain (YAML-like) mapping."""
    cfg = _build(Config, _with_moved_keys(_without_retired(data)))
    cfg.validate()
    return cfg


def _without_retired(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` without the ``debug`` section that configs saved before it was retired carry (all
    zeros: no fault set). A fault set there is an error: faults are injected by tests only, through
    ``train(cfg, hooks=[...])``."""
    if "debug" not in data:
        return data
    debug = data["debug"] or {}
    active = {k: v for k, v in debug.items() if v} if isinstance(debug, Mapping) else debug
    if active:
        raise ConfigError(
            f"the debug section ({active}) is no longer a config section: fault injection is for tests only "
            "and goes through train(cfg, hooks=[...]) (tests/resilience/faults.py); remove it"
        )
    return {k: v for k, v in data.items() if k != "debug"}


# Keys that moved to the section of the component that uses them: (old section, key) -> (new
# section, key). Configs written before the move (a run's saved config.yaml, a user's YAML, an
# override) still load, with a warning naming the new key.
MOVED_KEYS: dict[tuple[str, str], tuple[str, str]] = {
    ("train", "log_every"): ("log", "every"),
    ("run", "trackers"): ("log", "trackers"),
    ("run", "project"): ("log", "project"),
    ("train", "eval_every"): ("eval", "every"),
    ("train", "eval_batches"): ("eval", "batches"),
    ("run", "profile_steps"): ("profile", "steps"),
}


# Values renamed in place: {dotted key: {old value: new value}}. Configs written before (a run's
# saved config.yaml, a user's YAML, an override) still load, with a warning naming the new value.
RENAMED_VALUES: dict[str, dict[str, str]] = {
    "model.kernels": {"custom": "kernel"},
    "optim.kernels": {"custom": "kernel"},
}


def _renamed_value(key: str, value: Any) -> Any:
    new = RENAMED_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
    if new is None:
        return value
    warnings.warn(f"{key}={value} is now {key}={new}; the old value still works", FutureWarning, stacklevel=6)
    return new


def _warn_moved(old: tuple[str, str], where: str) -> None:
    new = MOVED_KEYS[old]
    warnings.warn(
        f"{where}: config key {'.'.join(old)} is now {'.'.join(new)}; the old name still works",
        FutureWarning,
        stacklevel=4,
    )


def _moved(keys: list[str], where: str) -> list[str]:
    """An override's dotted keys, at the new place of a moved key."""
    old = tuple(keys)
    if len(keys) == 2 and old in MOVED_KEYS:
        _warn_moved(old, where)  # type: ignore[arg-type]
        return list(MOVED_KEYS[old])  # type: ignore[index]
    return keys


def _with_moved_keys(data: Mapping[str, Any], where: str = "config") -> Mapping[str, Any]:
    """``data`` with the keys of :data:`MOVED_KEYS` at their new places (each YAML file is moved
    before files and overrides are merged, so the usual precedence holds); both spellings of one key
    in one mapping is an error (which one was meant cannot be told)."""
    found = [old for old in MOVED_KEYS if isinstance(data.get(old[0]), Mapping) and old[1] in data[old[0]]]
    if not found:
        return data
    out = {section: dict(value) if isinstance(value, Mapping) else value for section, value in data.items()}
    for old in found:
        new = MOVED_KEYS[old]
        value = out[old[0]].pop(old[1])
        target = out.setdefault(new[0], {})
        if not isinstance(target, dict):
            continue  # the section itself has the wrong type; _build says so
        if new[1] in target:
            raise ConfigError(
                f"{where}: {'.'.join(old)} and {'.'.join(new)} are both set; {'.'.join(old)} is the old "
                "name, remove it"
            )
        target[new[1]] = value
        _warn_moved(old, where)
    return out


def model_config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    cfg = _build(ModelConfig, data, "model")
    cfg.validate()
    return cfg


def load_config(
    name_or_path: str | Path | None = "tiny",
    overrides: Sequence[str] = (),
    *,
    model: Mapping[str, Any] | None = None,
) -> Config:
    """Load a preset (bare name -> ``configs/<name>.yaml``, or a YAML path) and apply dotted overrides.
    ``model``: a model section replacing the preset's (e.g. the one of ``train.init_from``'s
    weights); ``model.*`` overrides still apply on top of it."""
    data = _resolve_preset(name_or_path) if name_or_path is not None else {}
    if model is not None:
        data["model"] = dict(model)
    base = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        _apply_override(data, _moved(keys, f"override {text!r}"), value)
    try:
        return config_from_dict(data)
    except ConfigError as err:
        raise _attributed(err, name_or_path, base, bool(overrides)) from None


def _attributed(
    err: ConfigError, name_or_path: str | Path | None, base: dict[str, Any], overridden: bool
) -> ConfigError:
    """``err`` prefixed with the config file when the file alone already has it (no override is
    to blame), so the message says which file to open."""
    if name_or_path is None or str(err).startswith(str(name_or_path)):
        return err
    if overridden:
        try:
            config_from_dict(base)
        except ConfigError as own:
            if str(own) != str(err):
                return err
        else:
            return err
    return ConfigError(f"{_preset_path(name_or_path)}: {err}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A YAML-safe dict of a config dataclass (tuples become lists)."""

    def plain_value(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return to_dict(value)
        if isinstance(value, tuple):
            return [plain_value(v) for v in value]
        return value

    return {f.name: plain_value(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as YAML (atomically: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, dump_config(cfg))
