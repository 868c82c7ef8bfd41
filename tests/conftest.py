"""Test-session setup. XLA's CPU backend optimisation level 0 halves compile time, which dominates
these tests (tiny shapes, many distinct programs); numerics stay IEEE float32."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# The persistent compilation cache (runtime.compilation_cache_dir="auto") of the whole session,
# workers' subprocesses included, goes to a temporary directory, never the user's ~/.cache.
if "ZAYA_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["ZAYA_CACHE_DIR"] = tempfile.mkdtemp(prefix="zaya-test-cache-")
