"""The launch files in docs/launch describe the same job: the JobSet manifest parses and runs, under
``zaya supervise``, the same ``zaya train`` arguments as the sbatch script, and those arguments are
a config that loads."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

import zaya_jax

LAUNCH = Path(__file__).resolve().parents[1] / "docs" / "launch"


def _sbatch_train_args() -> list[str]:
    text = (LAUNCH / "zaya1-8b.sbatch").read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if "zaya train" in line]
    words = shlex.split(line)
    return words[words.index("train") + 1 :]


def test_the_jobset_and_the_sbatch_script_run_the_same_training():
    jobset = yaml.safe_load((LAUNCH / "zaya1-8b-jobset.yaml").read_text())
    assert jobset["kind"] == "JobSet"
    (job,) = jobset["spec"]["replicatedJobs"]
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["zaya", "supervise"]
    args = container["args"]
    assert args[:2] == ["zaya", "train"] and args[2:] == _sbatch_train_args()
    overrides = [a for a in args[2:] if "=" in a]
    cfg = zaya_jax.load_config(args[args.index("--config") + 1], overrides)
    assert cfg.mesh.optimizer_sharding == "zero1" and cfg.run.name == "z8b"
