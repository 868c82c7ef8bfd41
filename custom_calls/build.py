"""Build the zaya-jax custom-call libraries: always the CPU handlers, and GPU handlers from the one
source ``gpu/kernels.cu`` wherever a GPU compiler is found (CUDA with nvcc, ROCm with hipcc).

Run by the package build (``hatch_build.py``, i.e. ``pip install``) and by hand::

    python custom_calls/build.py [--out DIR] [--gpu auto|cuda|rocm|none] [--require]

Environment: ``ZAYA_KERNELS`` = ``auto`` (default: build what the toolchains allow, warn on
failure), ``require`` (a failed CPU build is an error) or ``off`` (build nothing); ``ZAYA_GPU`` =
``auto`` | ``cuda`` | ``rocm`` | ``none``; ``ZAYA_CUDA_ARCHS`` (default ``90``, H100/H200);
``ZAYA_HIP_ARCHS`` (default ``gfx942,gfx90a``, MI300X/MI250X). The XLA FFI headers come from the
installed jaxlib (what ``jax.ffi.include_dir()`` returns).

An AMD target the installed hipcc does not know (Debian's hipcc is ROCm 5.2, which stops at
``gfx90a``; MI300X's ``gfx942`` needs ROCm >= 6) is dropped from the library with a warning, and
its device code is still compiled to a gfx942 object by a newer clang where one is installed
(``clang++-19 -x hip --cuda-device-only -nogpulib``: the ISA is generated, the ROCm device
libraries are not linked), so that code that would not compile for MI300X fails here. What was
built for which targets is written to ``build.json`` beside the libraries (``zaya doctor`` reads
it). ``python custom_calls/build.py --device-code gfx942`` runs that device compile alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
# clang drivers that compile HIP for AMD targets newer than Debian's hipcc knows, newest first
DEVICE_CLANGS = ("clang++-21", "clang++-20", "clang++-19", "clang++-18", "amdclang++")
KERNEL_NAMES = ("norm_forward_kernel", "norm_backward_kernel", "gram_kernel", "update_kernel")


def include_dirs() -> list[str]:
    try:  # jaxlib (a build requirement) ships the headers: what jax.ffi.include_dir() points at
        import jaxlib
    except ImportError as err:
        raise RuntimeError("building the kernels needs jaxlib installed (for the XLA FFI headers)") from err
    headers = Path(jaxlib.__file__).resolve().parent / "include"
    if not (headers / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"jaxlib at {headers.parent} has no XLA FFI headers (needs jaxlib >= 0.4.31)")
    return [str(headers), str(HERE / "include"), str(HERE / "gpu")]


def hip_archs() -> list[str]:
    return [a for a in os.environ.get("ZAYA_HIP_ARCHS", "gfx942,gfx90a").split(",") if a]


def compile_commands(platform: str, out: Path, archs: list[str] | None = None) -> list[str]:
    includes = [f"-I{d}" for d in include_dirs()]
    target = str(out / LIBRARIES[platform])
    if platform == "cpu":
        compiler = os.environ.get("CXX", "g++")
        sources = [str(path) for path in sorted((HERE / "cpu").glob("*.cc"))]
        return [
            compiler,
            "-std=c++17",
            "-O3",
            "-fPIC",
            "-shared",
            "-fopenmp-simd",
            *QUIET,
            *includes,
            *sources,
            "-o",
            target,
        ]
    source = str(HERE / "gpu" / "kernels.cu")
    if platform == "cuda":
        archs = os.environ.get("ZAYA_CUDA_ARCHS", "90").split(",")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        return ["nvcc", "-std=c++17", "-O3", *gencode, "-Xcompiler", "-fPIC,-Wno-return-type", "-shared",
                "-diag-suppress", "940,2473", *includes, source, "-o", target]  # fmt: skip
    offload = [f"--offload-arch={a}" for a in (archs or hip_archs())]
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


def _run(cmd: list[str], env=None) -> tuple[bool, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, str(err)
    return proc.returncode == 0, proc.stderr[-3000:]


def _compile_library(platform: str, out: Path, log) -> tuple[bool, str, list[str]]:
    """One library; for ROCm, the targets hipcc rejects are dropped and the rest retried.
    Returns (built, error text, dropped AMD targets)."""
    archs = hip_archs() if platform == "rocm" else []
    env = {**os.environ, "HIP_PLATFORM": "amd"} if platform == "rocm" else None  # hipcc defaults to nvcc
    dropped: list[str] = []
    while True:
        ok, message = _run(compile_commands(platform, out, archs), env)
        unknown = set(re.findall(r"invalid target ID '([^':]+)", message)) & set(archs)
        if ok or platform != "rocm" or not unknown or unknown == set(archs):
            return ok, message, dropped
        dropped += sorted(unknown)
        archs = [a for a in archs if a not in unknown]
        log(f"zaya kernels: this hipcc does not know {', '.join(sorted(unknown))} (MI300X's gfx942 needs "
            f"ROCm >= 6); building the ROCm library for {', '.join(archs)}")  # fmt: skip


def device_clang() -> str | None:
    explicit = os.environ.get("ZAYA_HIP_CLANG")
    return explicit or next((c for c in DEVICE_CLANGS if shutil.which(c)), None)


def compile_device_code(arch: str, out: Path, clang: str | None = None) -> Path:
    """Compile the GPU source's device code for one AMD target to an (unlinked) code object
    ``out/zaya_kernels_<arch>.o`` and check that every kernel is in it; raises RuntimeError with
    the compiler's message. The ROCm device libraries are not linked (``-nogpulib``): their calls
    stay unresolved symbols, which a ROCm >= 6 hipcc resolves when it links the library."""
    clang = clang or device_clang()
    if clang is None:
        raise RuntimeError(f"no clang that targets {arch} is installed (tried {', '.join(DEVICE_CLANGS)})")
    out.mkdir(parents=True, exist_ok=True)
    asm, obj = out / f"zaya_kernels_{arch}.s", out / f"zaya_kernels_{arch}.o"
    includes = [f"-I{d}" for d in include_dirs()]
    steps = [
        [clang, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-nogpulib", "-std=c++17", "-O3",
         *QUIET, *includes, str(HERE / "gpu" / "kernels.cu"), "-S", "-o", str(asm)],
        [clang.replace("++", ""), "-target", "amdgcn-amd-amdhsa", f"-mcpu={arch}", "-c", str(asm), "-o", str(obj)],
    ]  # fmt: skip
    for cmd in steps:
        ok, message = _run(cmd)
        if not ok:
            raise RuntimeError(f"compiling the device code for {arch} failed:\n{' '.join(cmd)}\n{message}")
    text = asm.read_text()
    missing = [k for k in KERNEL_NAMES if not re.search(rf"\.amdhsa_kernel \S*{k}", text)]
    if f'"amdgcn-amd-amdhsa--{arch}' not in text or missing:
        raise RuntimeError(f"the {arch} code object lacks {missing or ['its target']}")
    return obj


def build(out: Path, gpu: str = "auto", require: bool = False, log=print) -> dict[str, Path]:
    """Compile into ``out``; returns {platform: library} for what was built, and writes
    ``out/build.json`` ({platform: {"archs": ..., "device_code_only": ...}}). Only a failed CPU
    build with ``require`` raises: GPU libraries are optional everywhere."""
    out.mkdir(parents=True, exist_ok=True)
    built, record = {}, {}
    for platform in ["cpu", *gpu_platforms(gpu)]:
        ok, message, dropped = _compile_library(platform, out, log)
        if ok:
            built[platform] = out / LIBRARIES[platform]
            log(f"zaya kernels: built {platform} -> {built[platform]}")
            record[platform] = {"archs": _archs(platform, dropped), "device_code_only": []}
        elif platform == "cpu" and require:
            cmd = " ".join(compile_commands(platform, out))
            raise RuntimeError(f"building the CPU kernels failed:\n{cmd}\n{message}")
        else:
            log(
                f"zaya kernels: {platform} build failed, the pure-JAX reference will be used there\n{message}"
            )
        for arch in dropped:
            try:
                compile_device_code(arch, out / "device_code")
                record.setdefault(platform, {"archs": [], "device_code_only": []})["device_code_only"].append(
                    arch
                )
                log(
                    f"zaya kernels: {arch} device code compiles ({device_clang()}), not linked into the library"
                )
            except RuntimeError as err:
                log(f"zaya kernels: {arch} device code not checked: {err}")
    (out / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    return built


def _archs(platform: str, dropped: list[str]) -> list[str]:
    if platform == "rocm":
        return [a for a in hip_archs() if a not in dropped]
    if platform == "cuda":
        return [f"sm_{a}" for a in os.environ.get("ZAYA_CUDA_ARCHS", "90").split(",")]
    return ["host"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "zaya_jax" / "ops" / "_lib")
    parser.add_argument(
        "--gpu", default=os.environ.get("ZAYA_GPU", "auto"), choices=["auto", "cuda", "rocm", "none"]
    )
    parser.add_argument("--require", action="store_true", help="fail if the CPU library does not build")
    parser.add_argument(
        "--device-code", metavar="ARCH", help="only compile the device code for one AMD target"
    )
    args = parser.parse_args(argv)
    if args.device_code:
        print(compile_device_code(args.device_code, args.out / "device_code"))
        return 0
    built = build(args.out, args.gpu, args.require, log=lambda m: print(m, file=sys.stderr))
    return 0 if "cpu" in built else 1


if __name__ == "__main__":
    sys.exit(main())
