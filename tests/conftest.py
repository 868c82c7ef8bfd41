"""Test-session setup. XLA's CPU backend optimisation level 0 halves compile time, which dominates
these tests (tiny shapes, many distinct programs); numerics stay IEEE float32."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
