"""The kernel sources build: the CPU library always, the one GPU source as CUDA (nvcc, sm_90) and
as HIP (hipcc, an AMD target; with a newer clang, MI300X's gfx942 device code too) where those
compilers exist; and the package trains with no kernels built at all (pure-JAX references),
giving the kernels' losses.

A missing compiler skips its test, except where ``ZAYA_REQUIRE_COMPILERS`` names it (CI sets
``nvcc hipcc clang++-19``): there a build that cannot run fails."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import MINI
from zaya_jax.cli import main

ROOT = Path(__file__).resolve().parents[2]
SYMBOLS = ("ZayaResidualRmsNormFwd", "ZayaResidualRmsNormBwd", "ZayaNewtonSchulz")


REQUIRED = set(os.environ.get("ZAYA_REQUIRE_COMPILERS", "").split())


def _need(compiler: str, what: str) -> None:
    if shutil.which(compiler):
        return
    message = f"{compiler} is not installed on this machine: {what} cannot be checked here"
    if compiler in REQUIRED:
        pytest.fail(f"{message}, and ZAYA_REQUIRE_COMPILERS requires it")
    pytest.skip(message)


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


def _defined(path: Path) -> set[str]:
    out = subprocess.run(["nm", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


def _sections(path: Path) -> str:
    return subprocess.run(["readelf", "-S", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize(
    ("platform", "compiler", "fatbin"),
    [("cuda", "nvcc", ".nv_fatbin"), ("rocm", "hipcc", ".hip_fatbin")],
)
def test_gpu_source_compiles(tmp_path, monkeypatch, platform, compiler, fatbin):
    """CUDA (sm_90) and ROCm with the default targets (gfx942, gfx90a): with Debian's hipcc the
    library is linked for what hipcc knows and gfx942's device code is compiled on its own to an
    AMDGPU object holding every kernel (by clang-19)."""
    _need(compiler, f"the {platform} build")
    module = _build_module()
    if platform == "rocm":
        _need(module.device_clang() or "clang++-19", "the gfx942 device code")
        monkeypatch.delenv("ZAYA_HIP_ARCHS", raising=False)
    built = module.build(tmp_path, gpu=platform, require=True, log=lambda _: None)
    assert platform in built, f"the {platform} build failed"
    assert set(SYMBOLS) <= _exported(built[platform])
    assert fatbin in _sections(built[platform])  # device code is in the library
    if platform != "rocm":
        return
    record = json.loads((tmp_path / "build.json").read_text())["rocm"]
    assert set(record["archs"]) | set(record["device_code_only"]) == {"gfx942", "gfx90a"}
    if "gfx942" in record["device_code_only"]:
        obj = tmp_path / "device_code" / "zaya_kernels_gfx942.o"
        header = subprocess.run(
            ["readelf", "-h", str(obj)], capture_output=True, text=True, check=True
        ).stdout
        assert "AMD GPU" in header or "AMDGPU" in header, header
        kernels = {s for s in _defined(obj) if "_kernel" in s}
        assert {k for k in module.KERNEL_NAMES if any(k in s for s in kernels)} == set(module.KERNEL_NAMES)


def test_device_code_compile_reports_a_broken_source(tmp_path, monkeypatch):
    module = _build_module()
    clang = module.device_clang()
    if clang is None:
        _need("clang++-19", "the gfx942 device code")
    broken = tmp_path / "src"
    (broken / "gpu").mkdir(parents=True)
    (broken / "gpu" / "kernels.cu").write_text("__global__ void norm_forward_kernel() { undeclared(); }\n")
    monkeypatch.setattr(module, "HERE", broken)
    with pytest.raises(RuntimeError, match="device code for gfx942 failed"):
        module.compile_device_code("gfx942", tmp_path / "out", clang)


def test_cpu_library_builds_and_exports_the_handlers(tmp_path):
    built = _build_module().build(tmp_path, gpu="none", require=True, log=lambda _: None)
    assert set(built) == {"cpu"}
    assert set(SYMBOLS) <= _exported(built["cpu"])


def test_trains_with_no_kernels_built(tmp_path, capsys):
    args = [*MINI, "train.steps=3"]  # model.kernels and optim.kernels auto: XLA's ops where none is built
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
