"""Orbax checkpoints behind a small interface.

Layout of a run directory::

    <run>/config.yaml                 the resolved config
    <run>/checkpoints/<step>/         one Orbax checkpoint per step, items:
        params/                       the model parameters (a LoRA run's: its adapters only)
        base/                         (LoRA runs) the frozen base the adapters belong to: init_from, dtype, fingerprint
        balancing/                    the router balancing biases (non-gradient state)
        config/                       the resolved config again, so a step directory stands alone
        fingerprints/                 a fingerprint of every array above (checkpoint.fingerprint)
        train/                        (training checkpoints) step, optimizer and controller state
        data/                         (training checkpoints) the data position: tokens seen, stage, iterator

Only committed checkpoints (Orbax's atomic rename) are listed and restored. Restoring builds the
target shapes from the saved metadata with the *current* devices' sharding, so a checkpoint saved on
any mesh loads on a single CPU. Every loader finds its step through ``readable``: a step's structure
is checked before any array is read, restored arrays are checked against their fingerprints, and on
a run a damaged step is moved to ``<run>/quarantine/`` and the previous one used.
Retention (``keep``, ``keep_every``, ``keep_best``) is Orbax's preservation policies: a pure function
of the steps and their saved held-out losses, so every process decides the same, and the latest
step (the one a resume or a rollback needs) is always kept.

Modules: ``store`` (the manager, items, errors, verification, quarantine), ``readable`` (which step
a path names, the structural check of a step, the walk past damaged steps), ``training`` (train-state
checkpoints), ``local`` (the per-process local tier), ``model_files`` (model-only files).
"""

from zaya_jax.checkpoint.model_files import (
    describe,
    read_config,
    restore_model,
    same_model_run,
    save_model,
)
from zaya_jax.checkpoint.readable import check_step, first_readable
from zaya_jax.checkpoint.store import (
    CHECKPOINTS,
    MODEL_ITEMS,
    QUARANTINE,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    manager,
    quarantine,
    verify,
)
from zaya_jax.checkpoint.training import (
    CheckpointSaveError,
    TrainingSaver,
    latest_step,
    restore_ahead,
    restore_training,
    save_training,
)

__all__ = [
    "CHECKPOINTS",
    "MODEL_ITEMS",
    "QUARANTINE",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "TrainingSaver",
    "check_step",
    "describe",
    "first_readable",
    "latest_step",
    "manager",
    "quarantine",
    "read_config",
    "restore_ahead",
    "restore_model",
    "restore_training",
    "same_model_run",
    "save_model",
    "save_training",
    "verify",
]
