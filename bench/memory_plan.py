"""Per-device memory as XLA plans it (``zaya train --compile-only``), for the shapes of issue 15:
the ``tiny`` train step on one device at 4k and 8k tokens, ``tiny`` with ZAYA1's 262k vocabulary,
the chunked loss against full logits, ``zaya1-8b`` on 64 devices at 4k and at 32k with context
parallelism, ``zaya1-8b`` in ZeRO-1 on 8 and 64 devices at 4k and 32k, and on 8 devices at 65k and 131k. Each plan runs in its own process (the fake device count is fixed at JAX start-up).

``--repo PATH`` plans with another checkout of zaya-jax (e.g. the commit before a change), so the
same script measures before and after. Prints one JSON object; bytes per device.

    python bench/memory_plan.py [--repo PATH] [--cases tiny_4k tiny_8k ...] [--target gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TINY_LONG = ["train.batch_size=1", "mesh.data=1", "model.max_position_embeddings=32768"]
ZAYA_4K = ["mesh.data=2", "mesh.fsdp=4", "mesh.expert=8", "train.micro_batches=4"]
# 32k context: 32 rows x 32k tokens per step (the 4k stage's 256 x 4k tokens per step, 1M), 4
# micro-batches; context 8 x expert 8: each device holds 4k tokens of one row, as at 4k.
ZAYA_32K = [
    "train.seq_len=32768",
    "train.batch_size=32",
    "train.micro_batches=4",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.expert=8",
    "mesh.context=8",
]

# ZeRO-1 (mesh.optimizer_sharding=zero1), ZAYA1's reported layout: parameters replicated, the
# optimizer state split over data. One row per device per micro-batch, as in the cases above.
ZERO1 = ["mesh.optimizer_sharding=zero1", "mesh.fsdp=1", "mesh.expert=1"]
ZERO1_32K = [*ZERO1, "train.seq_len=32768", "train.batch_size=32", "mesh.context=8"]
# Past 32k on 8 devices (one MI300X node): context 8, ZeRO-1 over the context axis, one row per
# micro-batch, the 32k stage's 1M tokens per step (16 rows of 65,536, 8 of 131,072).
ZERO1_65K = [*ZERO1, "mesh.data=1", "mesh.context=8", "train.seq_len=65536", "train.batch_size=16"]
CP8_131K = [
    "mesh.fsdp=1",
    "mesh.expert=1",
    "mesh.data=1",
    "mesh.context=8",
    "train.seq_len=131072",
    "train.batch_size=8",
]
ZERO1_131K = ["mesh.optimizer_sharding=zero1", *CP8_131K]

CASES = {
    "tiny_4k": ("tiny", 1, [*TINY_LONG, "train.seq_len=4096"]),
    "tiny_8k": ("tiny", 1, [*TINY_LONG, "train.seq_len=8192"]),
    "tiny_vocab262k_4k": ("tiny", 1, [*TINY_LONG, "train.seq_len=4096", "model.vocab_size=262144"]),
    "zaya1_8b_4k_64dev": ("zaya1-8b", 64, ZAYA_4K),
    "zaya1_8b_32k_cp8_64dev": ("zaya1-8b", 64, ZAYA_32K),  # zig-zag, the default layout
    "zaya1_8b_32k_cp8_64dev_contiguous": ("zaya1-8b", 64, [*ZAYA_32K, "mesh.context_layout=contiguous"]),
    "zaya1_8b_4k_zero1_8dev": ("zaya1-8b", 8, [*ZERO1, "mesh.data=8", "train.micro_batches=32"]),
    "zaya1_8b_4k_zero1_64dev": ("zaya1-8b", 64, [*ZERO1, "mesh.data=64", "train.micro_batches=4"]),
    "zaya1_8b_32k_zero1_8dev": ("zaya1-8b", 8, [*ZERO1_32K, "mesh.data=1", "train.micro_batches=32"]),
    "zaya1_8b_32k_zero1_64dev": ("zaya1-8b", 64, [*ZERO1_32K, "mesh.data=8", "train.micro_batches=4"]),
    "zaya1_8b_65k_zero1_8dev": ("zaya1-8b", 8, [*ZERO1_65K, "train.micro_batches=16"]),
    "zaya1_8b_131k_zero1_8dev": ("zaya1-8b", 8, [*ZERO1_131K, "train.micro_batches=8"]),
    "zaya1_8b_131k_cp8_8dev": ("zaya1-8b", 8, [*CP8_131K, "train.micro_batches=8"]),  # without ZeRO-1
    "zaya1_8b_131k_zero1_8dev_remat_full": (
        "zaya1-8b",
        8,
        [*ZERO1_131K, "train.micro_batches=8", "model.remat=full"],
    ),
}


def plan(repo: Path, preset: str, devices: int, overrides: list[str], target: str | None) -> dict:
    cmd = [sys.executable, "-m", "zaya_jax.cli", "train", "--config", preset, "--compile-only"]
    cmd += ["--devices", str(devices)]
    cli = repo / "zaya_jax" / "cli"
    sources = [cli.with_suffix(".py")] if cli.with_suffix(".py").is_file() else sorted(cli.glob("*.py"))
    if target and any("--target" in path.read_text() for path in sources):
        cmd += ["--target", target]
    env = {**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    proc = subprocess.run([*cmd, *overrides], capture_output=True, text=True, cwd=repo, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "failed"}
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    keep = ("planned_program", "platform_paths", "state_bytes_per_device", "argument_bytes_per_device")
    keep += ("temp_bytes_per_device", "peak_bytes_per_device")
    out = {k: report[k] for k in keep if k in report}
    out["compile_s"] = round(time.perf_counter() - start, 1)
    return out


def loss_only(repo: Path) -> dict:
    """Forward + backward temporaries of the loss alone at vocab 262,144 x 4,096 tokens (embed 128):
    full float32 logits against the chunked loss (only with a checkout that has it)."""
    code = """
import json, jax, jax.numpy as jnp
from zaya_jax.loss import token_losses
h = jax.ShapeDtypeStruct((1, 4096, 128), jnp.float32)
w = jax.ShapeDtypeStruct((262144, 128), jnp.float32)
t = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
def temp(fn):
    g = jax.jit(jax.grad(lambda h, w, t: fn(h, w, t).sum(), argnums=(0, 1)))
    return int(g.lower(h, w, t).compile().memory_analysis().temp_size_in_bytes)
out = {"full_logits": temp(lambda h, w, t: token_losses(h @ w.T, t)[0])}
try:
    from zaya_jax.ops.cross_entropy import chunked_cross_entropy
    out["chunked_auto"] = temp(lambda h, w, t: chunked_cross_entropy(h, w, t)[0])
except ImportError:
    pass
print(json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--cases", nargs="+", default=[*CASES, "loss_262k_4k"])
    parser.add_argument("--target", default="gpu", help="planned program (checkouts with --target)")
    args = parser.parse_args()
    repo = Path(args.repo).resolve()
    report = {"repo": str(repo), "target": args.target, "cases": {}}
    for name in args.cases:
        if name == "loss_262k_4k":
            report["cases"][name] = loss_only(repo)
        else:
            preset, devices, overrides = CASES[name]
            report["cases"][name] = plan(repo, preset, devices, overrides, args.target)
        print(json.dumps({name: report["cases"][name]}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
