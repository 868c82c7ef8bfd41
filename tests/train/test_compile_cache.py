"""The persistent compilation cache: a second identical ``zaya train`` compiles nothing new, and
``zaya_jax.train.train(cfg)`` from Python (a notebook that used JAX before) sets it up as the
command does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.train.test_loop import MINI
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


def test_a_second_run_reuses_every_compiled_program(tmp_path):
    cache = tmp_path / "xla"
    _train(tmp_path / "first", cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert entries
    _train(tmp_path / "second", cache)
    assert sorted(p.name for p in cache.iterdir()) == entries  # all hits, nothing recompiled


NOTEBOOK = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp
import zaya_jax
from tests.train.test_loop import MINI
from zaya_jax.train import train

jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # JAX used before, no cache yet
cache, runs = Path(sys.argv[1]), Path(sys.argv[2])
base = [*MINI, "train.steps=1", f"runtime.compilation_cache_dir={cache}"]
train(zaya_jax.load_config("tiny", [*base, f"run.dir={runs / 'a'}"]), progress=False)
first = sorted(p.name for p in cache.iterdir())
train(zaya_jax.load_config("tiny", [*base, f"run.dir={runs / 'b'}"]), progress=False)  # same process
print(json.dumps({"first": first, "second": sorted(p.name for p in cache.iterdir())}))
"""


def test_train_from_python_uses_the_compilation_cache(tmp_path):
    cache = tmp_path / "xla"
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    cmd = [sys.executable, "-c", NOTEBOOK, str(cache), str(tmp_path / "runs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = json.loads(proc.stdout.strip().splitlines()[-1])
    assert entries["first"]  # the run's programs went to runtime.compilation_cache_dir
    assert entries["second"] == entries["first"]  # the second run in the process: all hits


def test_cache_location():
    env = {"ZAYA_CACHE_DIR": "/scratch/z", "XDG_CACHE_HOME": "/x"}
    assert compilation_cache_path("auto", env) == compilation_cache_path("/scratch/z/xla", {})
    assert str(compilation_cache_path("auto", {"XDG_CACHE_HOME": "/x"})) == "/x/zaya-jax/xla"
    assert compilation_cache_path("", env) is None
    assert os.fspath(compilation_cache_path("~/c", {})).endswith("/c")
