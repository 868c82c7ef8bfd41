"""The persistent compilation cache: ``zaya_jax.train.train(cfg)`` from Python (a notebook that
used JAX before) sets it up as ``zaya train`` does, and a second identical run, from Python or from
the command, compiles nothing new."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.fixtures import MINI
from zaya_jax.parallel.distributed import compilation_cache_path


def _train(run, cache) -> None:
    cmd = [
        sys.executable,
        "-m",
        "zaya_jax.cli",
        "train",
        *MINI,
        f"run.dir={run}",
        "train.steps=1",
        "--no-progress",
    ]
    cmd.append(f"runtime.compilation_cache_dir={cache}")
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # cache every program
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


NOTEBOOK = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp
import zaya_jax
from tests.fixtures import MINI
from zaya_jax.train import train

jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # JAX used before, no cache yet
cache, runs = Path(sys.argv[1]), Path(sys.argv[2])
base = [*MINI, "train.steps=1", f"runtime.compilation_cache_dir={cache}"]
train(zaya_jax.load_config("tiny", [*base, f"run.dir={runs / 'a'}"]), progress=False)
first = sorted(p.name for p in cache.iterdir())
train(zaya_jax.load_config("tiny", [*base, f"run.dir={runs / 'b'}"]), progress=False)  # same process
print(json.dumps({"first": first, "second": sorted(p.name for p in cache.iterdir())}))
"""


def test_python_and_the_command_share_the_cache_and_reuse_every_program(tmp_path):
    """A notebook-like process (JAX used first) runs ``train(cfg)`` twice, then ``zaya train``
    runs the same config: the first run fills ``runtime.compilation_cache_dir``; the second run in
    the process compiles nothing new, and the command finds the run's programs in the cache."""
    cache = tmp_path / "xla"
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # cache every program
    cmd = [sys.executable, "-c", NOTEBOOK, str(cache), str(tmp_path / "runs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = json.loads(proc.stdout.strip().splitlines()[-1])
    assert entries["first"]  # the run's programs went to runtime.compilation_cache_dir
    assert entries["second"] == entries["first"]  # the second run in the process: all hits
    _train(tmp_path / "runs" / "c", cache)
    added = {p.name for p in cache.iterdir()} - set(entries["first"])
    # The command compiles the run's programs no differently: the state init, train step,
    # evaluation and checkpoint fingerprints are all hits. (It may add a tiny op such as a dtype
    # conversion that the notebook-like process compiled before its cache was on.)
    run_programs = ("jit__init-", "jit_step-", "jit_evaluate-", "jit__fingerprints-")
    assert all(any(name.startswith(p) for name in entries["first"]) for p in run_programs)
    assert not [name for name in added if name.startswith(run_programs)], added


def test_cache_location():
    env = {"ZAYA_CACHE_DIR": "/scratch/z", "XDG_CACHE_HOME": "/x"}
    assert compilation_cache_path("auto", env) == compilation_cache_path("/scratch/z/xla", {})
    assert str(compilation_cache_path("auto", {"XDG_CACHE_HOME": "/x"})) == "/x/zaya-jax/xla"
    assert compilation_cache_path("", env) is None
    assert os.fspath(compilation_cache_path("~/c", {})).endswith("/c")
