"""A run directory: its file names, and how ``zaya train`` may use it (start, resume, refuse).

Layout::

    <run>/config.yaml      the resolved config of the run
    <run>/checkpoints/     Orbax checkpoints (zaya_jax.checkpoint)
    <run>/metrics.jsonl    one JSON object per logged step (and per evaluation)
    <run>/events.jsonl     run events: start, resume, skip, rollback, stop, end, supervisor lines
    <run>/summary.json     the summary of the last completed ``zaya train``
    <run>/tb/              TensorBoard event files
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from zaya_jax import checkpoint
from zaya_jax.config import EXECUTION_FIELDS, Config, ConfigError, load_config, save_config
from zaya_jax.files import EVENTS, filter_jsonl, write_atomic


@dataclasses.dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.path / checkpoint.CHECKPOINTS

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / EVENTS

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    def has_training_checkpoint(self) -> bool:
        return self.checkpoints.is_dir() and any((p / "train").is_dir() for p in self.checkpoints.iterdir())

    def has_any_checkpoint(self) -> bool:
        return self.checkpoints.is_dir() and any(p.name.isdigit() for p in self.checkpoints.iterdir())

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines logged after ``step`` (the steps a resumed or rolled-back run repeats)."""
        filter_jsonl(self.metrics, lambda record: record["step"] <= step)

    def write_summary(self, summary: dict) -> None:
        write_atomic(self.summary, json.dumps(summary, indent=2))

    @classmethod
    def open(cls, cfg: Config) -> tuple[RunDir, bool]:
        """The run directory of ``cfg`` prepared for training: (run, resuming). Decided by the first
        process and followed by the others.

        A directory holding training checkpoints is resumed (with the same ``model.*`` only); a run
        of this very config that died before its first checkpoint is started again (its logs are
        truncated); any other non-empty directory is refused, so nothing saved is overwritten."""
        run = cls(cfg.run.path)
        resuming = False
        if jax.process_index() == 0:
            resuming = run._prepare(cfg)
        if jax.process_count() > 1:
            resuming = bool(multihost_utils.broadcast_one_to_all(np.int32(resuming)))
        return run, resuming

    def _prepare(self, cfg: Config) -> bool:
        if os.path.lexists(self.checkpoints) and not self.checkpoints.is_dir():
            state = "a broken link" if self.checkpoints.is_symlink() else "not a directory"
            raise FileNotFoundError(
                f"{self.checkpoints} is {state}; restore the checkpoints it stood for, or move it away to "
                "start this run again"
            )
        resuming = self.has_training_checkpoint()
        if not resuming and self._crashed_before_first_checkpoint(cfg):
            self.truncate_metrics(0)  # its logged steps are re-run from scratch
            return False
        # events.jsonl alone is a supervisor's log from before the trainer's first start
        if not resuming and self.has_any_checkpoint():
            raise FileExistsError(
                f"run directory {self.path} holds model weights without training state (zaya convert writes "
                f"such runs); to train from them give them as the starting point of a new run: zaya train "
                f"--init-from {self.path} run.dir=NEW_DIR"
            )
        if not resuming and self.path.exists() and any(p.name != EVENTS for p in self.path.iterdir()):
            raise FileExistsError(
                f"run directory {self.path} already holds a run without training checkpoints to resume "
                f"from (nothing complete in {self.checkpoints}); choose another run.name (or run.dir) or move "
                "the old run away"
            )
        if (
            resuming
            and self.config.is_file()
            and load_config(self.config).model.architecture() != cfg.model.architecture()
        ):
            raise ConfigError(
                f"{self.path} was trained with a different model config; resume with the same model.* "
                "values (see its config.yaml; only how it is computed may change: "
                f"{', '.join('model.' + f for f in EXECUTION_FIELDS)}) or choose another run.name"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        if not resuming:  # a resumed run's is saved once its history is checked (:meth:`continue_with`)
            save_config(cfg, self.config)
        return resuming

    def continue_with(self, cfg: Config, tokens_seen: int | None) -> None:
        """A resumed run's config, once its checkpoint is restored (``tokens_seen``: the tokens it has
        trained; None: nothing restored): refused when its curriculum would have trained those
        tokens otherwise than the saved config (:meth:`~zaya_jax.config.TrainConfig.history_change`),
        else saved as the run's config (by the first process)."""
        if tokens_seen and self.config.is_file():
            before = load_config(self.config)
            change = cfg.train.history_change(before.train, tokens_seen)
            if change is not None:
                raise ConfigError(
                    f"{self.path} has trained {tokens_seen} tokens under the curriculum of its config.yaml and "
                    f"{change} over them; keep train.stages as they were over those tokens (changes may begin "
                    "after them: a later stage, or where the current one ends) or start a new run from its "
                    "weights (train.init_from)"
                )
        if jax.process_index() == 0:
            save_config(cfg, self.config)

    def _crashed_before_first_checkpoint(self, cfg: Config) -> bool:
        """A run of this very config that died before saving anything: only its logs are there, so
        starting it again loses nothing (a supervisor restarting it must not be refused)."""
        if not self.config.is_file() or self.has_any_checkpoint():
            return False  # committed checkpoints (model-only ones included) are never started over
        try:
            return load_config(self.config) == cfg
        except (ConfigError, ValueError):
            return False
