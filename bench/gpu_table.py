"""One markdown table of ``bench/gpu.sh``'s results, ready for ``bench/RESULTS.md``: attention
(every implementation per shape, ms and the ratio to the blocked kernel), every MoE path (ms,
useful TFLOP/s, ratio to ``sorted``), collective bus bandwidth per message size, custom kernels
against XLA, the ``small`` train step's tokens/s and MFU with ``moe_impl: auto``'s choice, and
what vLLM made of the quantized expert exports.
Reads the files gpu.sh wrote under its output folder; a missing one is a row saying so (a step that
timed out or failed), never an error.

    python bench/gpu_table.py gpu_out
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def last_json(path: Path) -> Any:
    """The last complete JSON value printed in ``path`` (benchmarks print progress lines first)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for start in range(len(lines) - 1, -1, -1):
        if lines[start].startswith(("{", "[")):
            try:
                return json.loads("\n".join(lines[start:]))
            except ValueError:
                continue
    return None


def _attention(out: Path) -> list[str]:
    report = last_json(out / "attention.json")
    if not report:
        return ["| attention | (no result) | | |"]
    rows = []
    for shape, result in report["shapes"].items():
        times = result["median_s"]
        blocked = min((t for n, t in times.items() if n.startswith("blocked")), default=None)
        for name, seconds in times.items():
            ratio = f"{seconds / blocked:.2f}× blocked" if blocked else ""
            rows.append(
                f"| attention {shape} ({report['dtype']}) | {name} | {seconds * 1e3:.2f} ms | {ratio} |"
            )
    return rows


def _moe(out: Path) -> list[str]:
    report = last_json(out / "moe_paths.json")
    if not report:
        return ["| MoE paths | (no result) | | |"]
    shape = report["shape"]
    label = f"MoE {shape['tokens']} tok, E{shape['experts']} h{shape['hidden']} I{shape['inner']} {shape['dtype']}"
    return [
        f"| {label} | {name} | {ms:.2f} ms, {report['useful_tflops'][name]:.1f} TFLOP/s | "
        f"{(report['vs_sorted'] or {}).get(name, '')}× sorted |"
        for name, ms in report["ms"].items()
    ]


def _collectives(out: Path) -> list[str]:
    report = last_json(out / "collectives.json")
    if not report:
        return ["| collectives | (no result) | | |"]
    if report["devices"] == 1:
        return ["| collectives | one device | nothing moves | |"]
    return [
        f"| {name} ({report['devices']} devices) | {size} | {bandwidth} GB/s bus | |"
        for size, row in report["busbw_gb_s"].items()
        for name, bandwidth in row.items()
    ]


def _kernels(out: Path) -> list[str]:
    report = last_json(out / "kernels.json")
    if not report:
        return ["| custom kernels | (no result) | | |"]
    return [
        f"| custom kernel {key.removesuffix('_ratio')} | custom / XLA | {value}× | |"
        for key, value in report.items()
        if key.endswith("_ratio")
    ]


def _train(out: Path, name: str, label: str) -> list[str]:
    try:
        records = [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return [f"| {label} | (no result) | | |"]
    steps = [r for r in records if "tokens_per_s" in r]
    if not steps:
        return [f"| {label} | (no step logged) | | |"]
    last = steps[-1]
    mfu = last.get("mfu")
    return [
        f"| {label} | step {last['step']} | {last['tokens_per_s']:.0f} tokens/s | MFU {mfu if mfu is None else f'{mfu:.3f}'} |"
    ]


def _moe_choice(out: Path) -> list[str]:
    for name in ("small_events.jsonl", "small_4k_events.jsonl"):
        try:
            events = [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            continue
        for event in events:
            moe = event.get("detail", {}).get("moe")
            if event.get("event") == "start" and moe:
                timings = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in moe.get("seconds", {}).items())
                return [
                    f"| moe_impl auto ({name.split('_events')[0]}) | {moe['impl']} ({moe['source']}) | {timings} | |"
                ]
    report = last_json(out / "doctor_moe.json")  # zaya doctor --moe, when no train run started
    if report:
        timings = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in report.get("seconds", {}).items())
        return [f"| moe_impl auto (doctor --moe) | {report['impl']} ({report['source']}) | {timings} | |"]
    return ["| moe_impl auto | (no result) | | |"]


def _vllm(out: Path) -> list[str]:
    try:
        text = (out / "vllm_quantized.jsonl").read_text()
    except OSError:
        text = ""
    rows = []
    for line in text.splitlines():
        try:
            found = json.loads(line) if line.startswith("{") else None
        except ValueError:
            continue
        if isinstance(found, dict) and {"export", "vllm"} <= found.keys():
            rows.append(f"| vLLM, quantized expert exports | {found['export']} | {found['vllm']} | |")
    return rows or ["| vLLM, quantized expert exports | (no result) | | |"]


def table(out: Path) -> str:
    rows = ["| measure | variant | result | vs reference |", "|---|---|---|---|"]
    for part in (
        _attention(out),
        _moe(out),
        _collectives(out),
        _kernels(out),
        _moe_choice(out),
        _train(out, "small_metrics.jsonl", "train step, small, 2k"),
        _train(out, "small_4k_metrics.jsonl", "train step, small, 4k"),
        _vllm(out),
    ):
        rows += part
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")))
