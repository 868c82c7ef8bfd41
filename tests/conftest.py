"""Test-session setup. Compile time dominates these tests (tiny shapes, many distinct programs), so
XLA:CPU compiles with optimisation level 0 (half the compile time) and its older element-wise
emitters instead of the MLIR fusion emitters (a cold ``zaya train`` of the tests' miniature model
43 s -> 36 s, the same losses bit for bit; steps of the ``tiny`` preset run ~13% slower, which the
few long runs here do not notice); numerics stay IEEE float32. Every worker subprocess inherits
the flags."""

import os

import pytest

# Shared helper modules assert too: their failures show the values, as in a test module.
pytest.register_assert_rewrite("tests.fixtures", "tests.data.corpora", "tests.parallel.processes")

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
).strip()

# The persistent compilation cache (runtime.compilation_cache_dir="auto") of the whole session,
# workers' subprocesses included, goes to a temporary directory, never the user's ~/.cache.
if "ZAYA_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["ZAYA_CACHE_DIR"] = tempfile.mkdtemp(prefix="zaya-test-cache-")
# Every program goes into it, not only those compiling for over a second (JAX's default): the tests'
# miniature programs compile in fractions of a second, again in every process that launches one.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
