"""The kernel sources build: the CPU library always, the one GPU source as CUDA (nvcc, sm_90) and
as HIP (hipcc, an AMD target) where those compilers exist; and the package trains with no
kernels built at all (pure-JAX references), giving the kernels' losses."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.test_loop import MINI
from zaya_jax.cli import main

ROOT = Path(__file__).resolve().parents[2]
SYMBOLS = ("ZayaResidualRmsNormFwd", "ZayaResidualRmsNormBwd", "ZayaNewtonSchulz")


def _build_module():
    spec = importlib.util.spec_from_file_location(
        "zaya_custom_calls_build", ROOT / "custom_calls" / "build.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exported(path: Path) -> set[str]:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    )
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


def _sections(path: Path) -> str:
    return subprocess.run(["readelf", "-S", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize(
    ("platform", "compiler", "fatbin"),
    [("cuda", "nvcc", ".nv_fatbin"), ("rocm", "hipcc", ".hip_fatbin")],
)
def test_gpu_source_compiles(tmp_path, monkeypatch, platform, compiler, fatbin):
    if not shutil.which(compiler):
        pytest.skip(
            f"{compiler} is not installed on this machine: the {platform} build cannot be checked here"
        )
    if platform == "rocm":
        # Debian's hipcc (ROCm 5.2) knows gfx90a but not MI300X's gfx942, which needs ROCm >= 6.
        monkeypatch.setenv("ZAYA_HIP_ARCHS", os.environ.get("ZAYA_TEST_HIP_ARCHS", "gfx90a"))
    built = _build_module().build(tmp_path, gpu=platform, require=True, log=lambda _: None)
    assert platform in built, f"the {platform} build failed"
    assert set(SYMBOLS) <= _exported(built[platform])
    assert fatbin in _sections(built[platform])  # device code is in the library


def test_cpu_library_builds_and_exports_the_handlers(tmp_path):
    built = _build_module().build(tmp_path, gpu="none", require=True, log=lambda _: None)
    assert set(built) == {"cpu"}
    assert set(SYMBOLS) <= _exported(built["cpu"])


def test_trains_with_no_kernels_built(tmp_path, capsys):
    args = [*MINI, "train.steps=3", "model.kernels=custom", "optim.kernels=custom"]
    env = {**os.environ, "ZAYA_KERNELS_DIR": str(tmp_path / "empty")}
    script = (
        "import json, sys; from zaya_jax import ops; from zaya_jax.cli import main; "
        "print('STATUS ' + json.dumps(ops.kernel_status())); sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, "train", *args, f"run.dir={tmp_path / 'plain'}", "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    status = json.loads(next(line for line in lines if line.startswith("STATUS "))[7:])
    assert set(status.values()) == {"not built"}
    plain = json.loads("\n".join(line for line in lines if not line.startswith("STATUS ")))

    assert (
        main(["train", *args, f"run.dir={tmp_path / 'kernels'}", "--no-progress"]) == 0
    )  # kernels registered here
    with_kernels = json.loads(capsys.readouterr().out)
    assert abs(plain["final_loss"] - with_kernels["final_loss"]) <= 1e-4 * abs(with_kernels["final_loss"])
