"""What FP8 and MXFP4 experts change: a trained ``tiny`` and a square-expert config (experts as
wide as the residual, 16 of them: experts ~91% of the weights, as in ZAYA1-8B) exported as bfloat16,
``fp8-experts`` and ``mxfp4-experts`` (``zaya convert zaya-to-hf --quantize``; the files' sizes on
disk), and ``zaya eval RUN --quantize`` of each (held-out loss, greedy agreement, route changes per
layer). Also the exports' sizes at ZAYA1-8B's shapes, from the shapes alone. Prints markdown tables
and writes JSON.

    python bench/quantization.py --out /tmp/quant               # trains both (~6 min), then measures
    python bench/quantization.py --out /tmp/quant --skip-train  # measures finished runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

STEPS = 600
CONFIGS = {
    "tiny": [],
    "square": [
        "model.hidden_size=256",
        "model.moe_intermediate_size=256",
        "model.num_experts=16",
        "model.head_dim=64",
        "model.router_hidden_size=64",
    ],
}
KINDS = ("fp8-experts", "mxfp4-experts")


def zaya(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "zaya_jax.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"zaya {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def measure(run: Path, out: Path) -> dict:
    sizes = {}
    for kind in ("bfloat16", *KINDS):
        export = out / f"{run.name}-{kind}"
        if not export.exists():
            flags = ["--dtype", "bfloat16"] if kind == "bfloat16" else ["--quantize", kind]
            zaya("convert", "zaya-to-hf", str(run), str(export), *flags)
        sizes[kind] = disk_bytes(export)
    shape = ["--seq-len", "128", "--batch-size", "16", "--batches", "16"]
    reports = {
        kind: json.loads(zaya("eval", str(run), "--quantize", kind, "--json", *shape)) for kind in KINDS
    }
    return {"disk_bytes": sizes, "reports": reports}


def zaya1_8b_sizes() -> dict:
    from zaya_jax.config import ModelConfig
    from zaya_jax.interop.hf.quantized import export_bytes

    cfg = ModelConfig()
    return {kind: export_bytes(cfg, kind)["total"] for kind in ("none", "fp8", "mxfp4")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/quantization", help="runs and exports go here")
    parser.add_argument("--skip-train", action="store_true", help="measure finished runs")
    args = parser.parse_args()
    out = Path(args.out)
    results: dict = {"zaya1_8b_bytes": zaya1_8b_sizes()}
    for name, overrides in CONFIGS.items():
        run = out / name
        if not args.skip_train:
            zaya("train", "tiny", *overrides, f"train.steps={STEPS}", f"run.dir={run}", "--no-progress")
        results[name] = measure(run, out)
    (out / "quantization.json").write_text(json.dumps(results, indent=2) + "\n")

    print("| config | export | on disk | x bfloat16 | held-out loss (bf16 -> quantized) | greedy agreement |"
          " tokens routed elsewhere, per layer | skip share, per layer (bf16 -> quantized) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        sizes = results[name]["disk_bytes"]
        print(f"| {name} | bfloat16 | {sizes['bfloat16'] / 1e6:.2f} MB | 1 | | | | |")
        for kind in KINDS:
            r = results[name]["reports"][kind]
            layers = ", ".join(f"{x:.2%}" for x in r["route_change_by_layer"])
            skips = r["skip_share_by_layer"]
            skip = ", ".join(f"{a:.1%}->{b:.1%}" for a, b in zip(skips["bfloat16"], skips[kind], strict=True))
            loss = r["loss"]
            print(
                f"| {name} | {kind} | {sizes[kind] / 1e6:.2f} MB | {sizes[kind] / sizes['bfloat16']:.3f} | "
                f"{loss['bfloat16']:.4f} -> {loss[kind]:.4f} ({r['loss_change']:+.4f}) | "
                f"{r['greedy_agreement']:.2%} | {layers} | {skip} |"
            )
    z = results["zaya1_8b_bytes"]
    print(
        f"\nZAYA1-8B (shapes only): bfloat16 {z['none'] / 1e9:.2f} GB, fp8-experts {z['fp8'] / 1e9:.2f} GB "
        f"({z['fp8'] / z['none']:.3f}x), mxfp4-experts {z['mxfp4'] / 1e9:.2f} GB ({z['mxfp4'] / z['none']:.3f}x)"
    )


if __name__ == "__main__":
    main()
