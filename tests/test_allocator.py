"""The ``zaya`` command's host allocator: a plain install runs it under mimalloc from its wheel
(no system package), tcmalloc and the system's malloc on request, a clear error for a wrong path or
a missing library, the page faults it removes, and the one-line warning on the slow path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from zaya_jax.allocator import find_mimalloc, find_tcmalloc, slow_path_warning

CLI = [sys.executable, "-m", "zaya_jax.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ZAYA_ALLOCATOR_REEXECUTED")}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def _doctor(**extra: str) -> str:
    done = subprocess.run([*CLI, "doctor", "--json"], capture_output=True, text=True, env=_env(**extra))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["allocator"]  # --json survived the re-execution


def test_a_plain_install_runs_zaya_under_mimalloc_from_its_wheel():
    library = find_mimalloc()  # pyproject.toml's cmeel-mimalloc: no system package involved
    assert library is not None and ("site-packages" in library or "dist-packages" in library)
    assert _doctor() == library
    assert _doctor(ZAYA_ALLOCATOR="system") == "system malloc (ZAYA_ALLOCATOR=system)"
    if find_tcmalloc():
        assert "tcmalloc" in _doctor(ZAYA_ALLOCATOR="tcmalloc")


def test_the_slow_path_warning_names_the_cost_and_the_fix(monkeypatch):
    monkeypatch.setattr("zaya_jax.allocator.loaded_allocator", lambda: None)
    monkeypatch.setenv("ZAYA_ALLOCATOR", "system")
    assert "unset ZAYA_ALLOCATOR" in slow_path_warning() and "faults" in slow_path_warning()
    monkeypatch.setenv("ZAYA_ALLOCATOR", "auto")
    assert "python -m zaya_jax.allocator --env" in slow_path_warning()  # installed, not preloaded
    monkeypatch.setattr("zaya_jax.allocator.find_mimalloc", lambda: None)
    monkeypatch.setattr("zaya_jax.allocator.find_tcmalloc", lambda: None)
    assert "pip install cmeel-mimalloc" in slow_path_warning()
    monkeypatch.setattr("zaya_jax.allocator.loaded_allocator", lambda: "/x/libmimalloc.so")
    assert slow_path_warning() is None


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
    usage = resource.getrusage(resource.RUSAGE_SELF)
    before, start = usage.ru_minflt, usage.ru_stime
    for _ in range(4):
        f(x).block_until_ready()
    after = resource.getrusage(resource.RUSAGE_SELF)
    faults = (after.ru_minflt - before) / 4
    kernel_ms = (after.ru_stime - start) / 4 * 1e3
    print(json.dumps({"allocator": loaded_allocator(), "faults": faults, "kernel_ms": kernel_ms}))
    """
)


def _faults(**extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS], capture_output=True, text=True, env=_env(**extra), check=True
    )
    return json.loads(done.stdout)


def test_the_default_allocator_stops_every_execution_faulting_in_its_temporary_buffer():
    system = _faults(ZAYA_ALLOCATOR="system")
    assert system["allocator"] is None
    assert system["faults"] > 16_000  # both 64 MiB operands, page by page, at every execution
    default = _faults()  # mimalloc from the wheel, with its purge delay off (zaya_jax.allocator)
    assert "mimalloc" in default["allocator"]
    assert default["faults"] < system["faults"] / 20, (default, system)
    purging = _faults(MIMALLOC_PURGE_DELAY="0")  # mimalloc's own setting wins: it purges at once
    assert purging["faults"] > default["faults"] or purging["kernel_ms"] > 5 * default["kernel_ms"] + 5, (
        purging,
        default,
    )
    if find_tcmalloc():
        tcmalloc = _faults(ZAYA_ALLOCATOR="tcmalloc")
        assert "tcmalloc" in tcmalloc["allocator"]
        assert tcmalloc["faults"] < system["faults"] / 20, (tcmalloc, system)


def test_a_missing_named_allocator_exits_2_with_the_install_command(monkeypatch):
    missing = "tcmalloc" if find_tcmalloc() is None else None
    if missing is None:  # tcmalloc is here: check the message of a missing mimalloc in process
        monkeypatch.setenv("ZAYA_ALLOCATOR", "mimalloc")
        monkeypatch.setattr("zaya_jax.allocator.find_mimalloc", lambda: None)
        from zaya_jax.allocator import AllocatorError, wanted_library

        with pytest.raises(AllocatorError, match="pip install cmeel-mimalloc"):
            wanted_library()
        return
    done = subprocess.run(
        [*CLI, "doctor"], capture_output=True, text=True, env=_env(ZAYA_ALLOCATOR="tcmalloc")
    )
    assert done.returncode == 2 and "apt-get install libtcmalloc-minimal4" in done.stderr
