"""Build the zaya-jax custom-call libraries: always the CPU handlers, and GPU handlers from the one
source ``gpu/kernels.cu`` wherever a GPU compiler is found (CUDA with nvcc, ROCm with hipcc).

Run by the package build (``hatch_build.py``, i.e. ``pip install``) and by hand::

    python custom_calls/build.py [--out DIR] [--gpu auto|cuda|rocm|none] [--require]

Environment: ``ZAYA_KERNELS`` = ``auto`` (default: build what the toolchains allow, warn on
failure), ``require`` (a failed CPU build is an error) or ``off`` (build nothing); ``ZAYA_GPU`` =
``auto`` | ``cuda`` | ``rocm`` | ``none``; ``ZAYA_CUDA_ARCHS`` (default ``90``, H100/H200);
``ZAYA_HIP_ARCHS`` (default ``gfx942,gfx90a``, MI300X/MI250X). The XLA FFI headers come from the
installed jaxlib (what ``jax.ffi.include_dir()`` returns).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBRARIES = {
    "cpu": "libzaya_kernels_cpu.so",
    "cuda": "libzaya_kernels_cuda.so",
    "rocm": "libzaya_kernels_rocm.so",
}
# The headers warn about their own missing returns after exhaustive switches; nothing of ours.
QUIET = ["-Wno-return-type"]


def include_dirs() -> list[str]:
    try:  # jaxlib (a build requirement) ships the headers: what jax.ffi.include_dir() points at
        import jaxlib
    except ImportError as err:
        raise RuntimeError("building the kernels needs jaxlib installed (for the XLA FFI headers)") from err
    headers = Path(jaxlib.__file__).resolve().parent / "include"
    if not (headers / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"jaxlib at {headers.parent} has no XLA FFI headers (needs jaxlib >= 0.4.31)")
    return [str(headers), str(HERE / "include"), str(HERE / "gpu")]


def compile_commands(platform: str, out: Path) -> list[str]:
    includes = [f"-I{d}" for d in include_dirs()]
    target = str(out / LIBRARIES[platform])
    if platform == "cpu":
        compiler = os.environ.get("CXX", "g++")
        source = str(HERE / "cpu" / "kernels_cpu.cc")
        return [
            compiler,
            "-std=c++17",
            "-O3",
            "-fPIC",
            "-shared",
            "-fopenmp-simd",
            *QUIET,
            *includes,
            source,
            "-o",
            target,
        ]
    source = str(HERE / "gpu" / "kernels.cu")
    if platform == "cuda":
        archs = os.environ.get("ZAYA_CUDA_ARCHS", "90").split(",")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        return ["nvcc", "-std=c++17", "-O3", *gencode, "-Xcompiler", "-fPIC,-Wno-return-type", "-shared",
                "-diag-suppress", "940,2473", *includes, source, "-o", target]  # fmt: skip
    archs = os.environ.get("ZAYA_HIP_ARCHS", "gfx942,gfx90a").split(",")
    offload = [f"--offload-arch={a}" for a in archs]
    return ["hipcc", "-x", "hip", "-std=c++17", "-O3", "-fPIC", "-shared", *offload, *QUIET, *includes, source,
            "-o", target]  # fmt: skip


def gpu_platforms(choice: str) -> list[str]:
    if choice == "none":
        return []
    if choice in ("cuda", "rocm"):
        return [choice]
    found = []
    if shutil.which("nvcc"):
        found.append("cuda")
    if shutil.which("hipcc"):
        found.append("rocm")
    return found


def build(out: Path, gpu: str = "auto", require: bool = False, log=print) -> dict[str, Path]:
    """Compile into ``out``; returns {platform: library} for what was built. Only a failed CPU build
    with ``require`` raises: GPU libraries are optional everywhere."""
    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for platform in ["cpu", *gpu_platforms(gpu)]:
        cmd = compile_commands(platform, out)
        env = {**os.environ, "HIP_PLATFORM": "amd"} if platform == "rocm" else None  # hipcc defaults to nvcc
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as err:
            proc = None
            message = str(err)
        if proc is not None and proc.returncode == 0:
            built[platform] = out / LIBRARIES[platform]
            log(f"zaya kernels: built {platform} -> {built[platform]}")
            continue
        message = proc.stderr[-3000:] if proc is not None else message
        if platform == "cpu" and require:
            raise RuntimeError(f"building the CPU kernels failed:\n{' '.join(cmd)}\n{message}")
        log(f"zaya kernels: {platform} build failed, the pure-JAX reference will be used there\n{message}")
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "zaya_jax" / "ops" / "_lib")
    parser.add_argument(
        "--gpu", default=os.environ.get("ZAYA_GPU", "auto"), choices=["auto", "cuda", "rocm", "none"]
    )
    parser.add_argument("--require", action="store_true", help="fail if the CPU library does not build")
    args = parser.parse_args(argv)
    built = build(args.out, args.gpu, args.require, log=lambda m: print(m, file=sys.stderr))
    return 0 if "cpu" in built else 1


if __name__ == "__main__":
    sys.exit(main())
