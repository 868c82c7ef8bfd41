"""Test-session setup. Compile time dominates these tests (tiny shapes, many distinct programs), so
XLA:CPU compiles with optimisation level 0 (half the compile time) and its older element-wise
emitters instead of the MLIR fusion emitters (a cold ``zaya train`` of the tests' miniature model
43 s -> 36 s, the same losses bit for bit; steps of the ``tiny`` preset run ~13% slower, which the
few long runs here do not notice); numerics stay IEEE float32. Every worker subprocess inherits
the flags."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
).strip()

# The persistent compilation cache (runtime.compilation_cache_dir="auto") of the whole session,
# workers' subprocesses included, goes to a temporary directory, never the user's ~/.cache.
if "ZAYA_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["ZAYA_CACHE_DIR"] = tempfile.mkdtemp(prefix="zaya-test-cache-")


# The longest files first (seconds measured on the 2-core CI machine class, one worker each): with
# `-n 2 --dist loadfile` each file runs whole on one worker, handed out in collection order as
# workers free up, so starting with the longest leaves short files to even out the end instead of
# one worker finishing a long file alone.
_LONGEST_FIRST = (
    "tests/parallel/test_layouts.py",
    "tests/resilience/test_faults.py",
    "tests/parallel/test_slurm.py",
    "tests/parallel/test_multiprocess.py",
    "tests/test_generate.py",
    "tests/train/test_resume.py",
    "tests/train/test_plan.py",
    "tests/test_harness.py",
    "tests/resilience/test_campaign.py",
    "tests/ops/test_attention.py",
    "notebooks/checkpoints.ipynb",
    "tests/train/test_rl.py",
    "tests/train/test_step.py",
    "notebooks/muon_vs_adamw.ipynb",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    root = config.rootpath

    def key(item):
        try:
            path = item.path.relative_to(root).as_posix()
        except ValueError:
            path = str(item.path)
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order within a file and among the others is kept
