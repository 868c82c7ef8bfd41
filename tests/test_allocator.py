"""The ``zaya`` command's host allocator: a plain install runs it under mimalloc from its wheel
(no system package), tcmalloc and the system's malloc on request, a clear error for a wrong path or
a missing library, the settings it runs with (mimalloc keeps freed memory mapped), and the one-line
warning on the slow path. The page faults it saves are measured in bench/ (bench/train_vs_hf.py
``--allocators``), not here: their count depends on the machine and its load."""

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


# The child of a ``zaya supervise`` reads what its parent, the zaya command's process, runs with: the
# allocator libraries mapped in /proc/<pid>/maps and the allocator settings in /proc/<pid>/environ.
_PARENT = textwrap.dedent(
    """
    import json, os
    pid = os.getppid()
    with open(f"/proc/{pid}/maps") as f:
        mapped = {p[-1] for p in map(str.split, f) if len(p) > 5 and "malloc" in os.path.basename(p[-1])}
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.decode().partition("=")[::2] for item in f.read().split(b"\\0") if item)
    keys = ("LD_PRELOAD", "MIMALLOC_PURGE_DELAY", "MIMALLOC_ALLOW_THP")
    print(json.dumps({"pid": pid, "mapped": sorted(mapped), **{k: env.get(k) for k in keys}}))
    """
)


def _zaya_process(run_dir, **extra: str) -> tuple[dict, str]:
    """What a ``zaya`` command's process runs with (its pid, the ``*malloc*`` libraries mapped in it,
    ``LD_PRELOAD`` and mimalloc's settings in its environment), and its stderr."""
    command = [*CLI, "supervise", "--run-dir", str(run_dir), "--", sys.executable, "-c", _PARENT]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(**extra)
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["pid"] == proc.pid  # re-executed in place: the process that was started
    return report, err


def test_the_zaya_command_runs_under_mimalloc_that_keeps_freed_memory_mapped(tmp_path):
    """What stops each CPU execution faulting its temporary buffers in afresh, on any machine under
    any load: the ``zaya`` process has the wheel's mimalloc mapped and ``MIMALLOC_PURGE_DELAY=-1``
    (keep freed memory) in its environment, which mimalloc itself reads. How many faults that saves
    is the machine's to say: ``python bench/train_vs_hf.py --allocators system mimalloc`` measures
    them (``page_faults_per_step``, ``page_faults_vs_system``; bench/RESULTS.md)."""
    library = find_mimalloc()
    report, err = _zaya_process(tmp_path / "default", MIMALLOC_VERBOSE="1")
    assert report["mapped"] == [library], report
    assert report["LD_PRELOAD"].split()[0] == library
    assert report["MIMALLOC_PURGE_DELAY"] == "-1" and report["MIMALLOC_ALLOW_THP"] == "0", report
    assert "option 'purge_delay': -1" in err  # mimalloc's own report of the option it runs with
    # a user's own mimalloc setting wins over zaya's
    report, _ = _zaya_process(tmp_path / "purging", MIMALLOC_PURGE_DELAY="0")
    assert report["mapped"] == [library] and report["MIMALLOC_PURGE_DELAY"] == "0", report
    # opting out: nothing preloaded, the C library's malloc, none of mimalloc's settings
    report, _ = _zaya_process(tmp_path / "system", ZAYA_ALLOCATOR="system")
    assert report["mapped"] == [] and report["LD_PRELOAD"] is None, report
    assert report["MIMALLOC_PURGE_DELAY"] is None, report
    if find_tcmalloc():
        report, _ = _zaya_process(tmp_path / "tcmalloc", ZAYA_ALLOCATOR="tcmalloc")
        assert len(report["mapped"]) == 1 and "tcmalloc" in report["mapped"][0], report


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
