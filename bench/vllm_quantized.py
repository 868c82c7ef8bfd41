"""Does vLLM serve zaya's quantized expert exports? A random ``tiny`` model exported as
``fp8-experts`` and ``mxfp4-experts`` (``zaya_jax.interop.hf.save_hf_directory``), each loaded by
``vllm.LLM`` (in a process of its own, a third of the GPU's memory) and asked for 8 greedy
tokens; prints one JSON line per format with what happened (``served``, or the error's last line). Upstream vLLM's ``zaya.py`` loads only bfloat16 fused
experts, so the expected outcome there is a refusal naming the scale tensors (docs/hf-interop.md).

    python bench/vllm_quantized.py --out /tmp/vllm_quantized
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

KINDS = ("fp8-experts", "mxfp4-experts")


def export(kind: str, out: Path) -> Path | str:
    from zaya_jax.config import load_config
    from zaya_jax.interop.hf import save_hf_directory
    from zaya_jax.model import init_variables

    cfg = load_config("tiny").model
    directory = out / kind
    if not directory.exists():
        try:
            save_hf_directory(directory, cfg, init_variables(cfg, 0), dtype="bfloat16", quantize=kind)
        except Exception as err:  # a missing library is an outcome to record
            return f"not exported: {str(err).splitlines()[-1]}"
    return directory


def serve(directory: Path) -> str:
    try:
        import vllm
    except ImportError:
        return "vllm is not installed"
    try:
        llm = vllm.LLM(
            model=str(directory), skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.3
        )
        params = vllm.SamplingParams(max_tokens=8, temperature=0.0)
        out = llm.generate([{"prompt_token_ids": [2, 40, 41, 42]}], params)
        return f"served: {list(out[0].outputs[0].token_ids)}"
    except Exception as err:  # what vLLM says is the measurement
        lines = [line for line in str(err).splitlines() if line.strip()]
        return f"refused: {type(err).__name__}: {lines[-1][:300] if lines else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/vllm_quantized")
    parser.add_argument("--one", choices=KINDS, help="(internal) export and serve this format only")
    parser.add_argument("--timeout", type=float, default=55.0, help="seconds per format")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        directory = export(args.one, out)
        outcome = directory if isinstance(directory, str) else serve(directory)
        print(json.dumps({"export": args.one, "vllm": outcome}))
        return
    for kind in KINDS:  # one process each: an engine holds its GPU memory until its process ends
        command = [sys.executable, __file__, "--out", str(out), "--one", kind]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            tail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
            print(lines[-1] if lines else json.dumps({"export": kind, "vllm": f"failed: {tail}"}))
        except subprocess.TimeoutExpired:
            print(json.dumps({"export": kind, "vllm": f"no answer in {args.timeout:.0f} s"}))


if __name__ == "__main__":
    main()
