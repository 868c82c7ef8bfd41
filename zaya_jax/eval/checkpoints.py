"""Every checkpoint of a run evaluated with the same settings (``zaya eval RUN --checkpoints``):
each chosen step is evaluated in turn into ``OUT/step-N`` (its ``scores.json`` written last and
atomically, so a step is either finished or evaluated again), steps already finished with the same
settings are skipped, so an evaluation killed half-way resumes where it stopped, and the finished
steps are gathered into one table, ``OUT/curve.jsonl`` (one line per step, in step order), to plot
beside the training curve.

A step already evaluated with other settings is refused rather than mixed into the curve: the
curve is of one evaluation. Which steps: ``all`` (every kept step), ``every:K`` (the kept steps
that are multiples of K) or a comma-separated list.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zaya_jax.checkpoint.readable import locate
from zaya_jax.checkpoint.store import manager
from zaya_jax.config import ConfigError
from zaya_jax.files import write_atomic

SCORES = "scores.json"
CURVE = "curve.jsonl"


def select_steps(run: str | Path, spec: str) -> list[int]:
    """The kept steps of ``run`` that ``spec`` chooses (``all``, ``every:K``, or ``S,S,...``)."""
    checkpoints, step = locate(run)
    if step is not None:
        raise ConfigError(f"--checkpoints needs a run directory, not the step directory {run}")
    kept = sorted(manager(checkpoints).all_steps())
    if spec == "all":
        chosen = kept
    elif spec.startswith("every:") and spec[6:].isdigit() and int(spec[6:]) > 0:
        chosen = [s for s in kept if s % int(spec[6:]) == 0]
    elif all(part.strip().isdigit() for part in spec.split(",")):
        chosen = sorted({int(part) for part in spec.split(",")})
        missing = [s for s in chosen if s not in kept]
        if missing:
            raise ConfigError(
                f"--checkpoints {spec}: step(s) {', '.join(map(str, missing))} are not kept in {checkpoints} "
                f"(kept: {', '.join(map(str, kept)) or 'none'})"
            )
    else:
        raise ConfigError(f"--checkpoints {spec}: give all, every:K, or a list of steps (1000,2000)")
    if not chosen:
        raise ConfigError(f"--checkpoints {spec} chooses no step of {checkpoints} (kept: {kept or 'none'})")
    return chosen


def evaluate_checkpoints(
    run: str | Path,
    steps: list[int],
    out: str | Path,
    settings: dict[str, Any],
    evaluate_step: Callable[[Path, Path], dict[str, Any]],
    say: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """``evaluate_step(step_dir, out_dir)`` (returning the step's scores, with ``settings`` among
    them, and writing ``out_dir/scores.json`` last) for each step not finished yet; returns the
    curve (each step's scores, in step order), also written to ``out/curve.jsonl``."""
    checkpoints, _ = locate(run)
    out = Path(out)
    curve = []
    for step in steps:
        finished = _finished(out / f"step-{step}", settings)
        if finished is not None:
            say(f"step {step}: evaluated already ({out / f'step-{step}' / SCORES})")
            curve.append(finished)
            continue
        say(f"step {step}: evaluating")
        scores = evaluate_step(checkpoints / str(step), out / f"step-{step}")
        curve.append(scores)
    lines = [json.dumps({"step": step, **scores}) + "\n" for step, scores in zip(steps, curve, strict=True)]
    write_atomic(out / CURVE, "".join(lines))
    return curve


def _finished(directory: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The scores of a step evaluated already with ``settings``; None when it is not; a refusal
    when it was evaluated with others."""
    path = directory / SCORES
    if not path.is_file():
        return None
    try:
        scores = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # a damaged result is evaluated again (the files are rewritten whole)
    theirs = scores.get("settings")
    if theirs != settings:
        changed = sorted(k for k in {*settings, *(theirs or {})} if (theirs or {}).get(k) != settings.get(k))
        raise ConfigError(
            f"{path} was evaluated with other settings ({', '.join(changed)}); give another --out, or remove "
            "it to evaluate that step again"
        )
    return scores
