"""The ``zaya`` command's host allocator: re-executed under tcmalloc where it is installed, the
system's malloc on request, a clear error for a wrong path, and the page faults it removes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from zaya_jax.allocator import find_tcmalloc

CLI = [sys.executable, "-m", "zaya_jax.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ZAYA_ALLOCATOR_REEXECUTED")}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def _doctor(**extra: str) -> str:
    done = subprocess.run([*CLI, "doctor", "--json"], capture_output=True, text=True, env=_env(**extra))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["allocator"]  # --json survived the re-execution


def test_zaya_runs_under_tcmalloc_where_installed_and_says_what_to_install_elsewhere():
    library = find_tcmalloc()
    if library:  # CI installs libtcmalloc-minimal4 (.ci/run)
        assert "tcmalloc" in _doctor() and os.path.basename(library).split(".so")[0] in _doctor()
    else:
        assert "install tcmalloc" in _doctor()
    assert _doctor(ZAYA_ALLOCATOR="system") == "system malloc (ZAYA_ALLOCATOR=system)"


def test_a_wrong_allocator_path_exits_2_naming_the_variable():
    done = subprocess.run(
        [*CLI, "doctor"], capture_output=True, text=True, env=_env(ZAYA_ALLOCATOR="/no/such/libmalloc.so")
    )
    assert done.returncode == 2
    assert "ZAYA_ALLOCATOR='/no/such/libmalloc.so': no such file" in done.stderr
    assert "Traceback" not in done.stderr


# A jitted program whose temporary buffer (two 64 MiB operands of the product) is far above glibc's
# mmap limits: the page faults of each execution, after a warm-up, in the allocator it runs under.
_FAULTS = textwrap.dedent(
    """
    import json, resource, sys
    from zaya_jax.allocator import loaded_allocator, reexec_with_allocator
    reexec_with_allocator()
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x: (jnp.tanh(x) @ jnp.exp(-x).T).sum())
    x = jnp.full((128, 131072), 0.5, jnp.float32)
    for _ in range(2):
        f(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        f(x).block_until_ready()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
    print(json.dumps({"allocator": loaded_allocator(), "faults": faults}))
    """
)


def _faults(**extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS], capture_output=True, text=True, env=_env(**extra), check=True
    )
    return json.loads(done.stdout)


def test_tcmalloc_stops_every_execution_faulting_in_its_temporary_buffer():
    system = _faults(ZAYA_ALLOCATOR="system")
    assert system["allocator"] is None
    assert system["faults"] > 16_000  # both 64 MiB operands, page by page, at every execution
    library = find_tcmalloc()
    if library is None:
        return  # nothing to compare with; the system's number above is what a user gets
    tcmalloc = _faults()
    assert "tcmalloc" in tcmalloc["allocator"]
    assert tcmalloc["faults"] < system["faults"] / 20, (tcmalloc, system)
