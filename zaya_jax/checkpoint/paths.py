"""Which checkpoint a path names: a run directory (its latest complete step) or a step directory."""

from __future__ import annotations

from pathlib import Path

from zaya_jax.checkpoint.store import CHECKPOINTS, CheckpointNotFoundError, manager


def resolve(path: str | Path) -> tuple[Path, int]:
    """(checkpoints dir, step) for a run directory (latest step) or a step directory."""
    path = Path(path)
    if (path / CHECKPOINTS).is_dir():
        checkpoints, step = path / CHECKPOINTS, None
    elif path.parent.name == CHECKPOINTS and path.name.isdigit():
        checkpoints, step = path.parent, int(path.name)
    else:
        raise CheckpointNotFoundError(
            f"{path} is neither a run directory (with {CHECKPOINTS}/) nor a step directory ({CHECKPOINTS}/<step>)"
        )
    steps = manager(checkpoints).all_steps()
    if step is None:
        if not steps:
            raise CheckpointNotFoundError(f"{checkpoints} holds no complete checkpoint")
        step = max(steps)
    elif step not in steps:
        raise CheckpointNotFoundError(
            f"{checkpoints / str(step)} is not a complete checkpoint (complete: {sorted(steps)})"
        )
    return checkpoints, step
