"""``bench/gpu.sh``'s plumbing on CPU (``PLUMBING=1``: tiny sizes, 8 fake devices for the
collectives): the doctor and its MoE timings, the attention benchmark, every MoE
path, the collectives and the kernels against XLA run, and the closing table has a row of results
for each, so the one lent-GPU run is not lost to a broken script. What other tests cover is left
out with ``SKIP`` to keep CI short (the kernel build, which ``pip install`` ran and
tests/ops/test_build.py tests; the HF comparison, Muon, checkpoint, data, decoding, the
``zaya train`` runs, vLLM given the quantized exports (tests/interop/test_quantized.py writes
them); the Pallas kernel, interpreted, is tests/ops/test_pallas_attention.py);
``PLUMBING=1 bash bench/gpu.sh`` runs them all (3.5 min on this 2-core machine)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_plumbing_runs_every_step_and_prints_the_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "ZAYA_CACHE_DIR")}
    skip = "build hf muon checkpoint data decoding small small_4k vllm"  # covered by other tests
    env.update(
        PLUMBING="1",
        OUT=str(tmp_path / "out"),
        SKIP=skip,
        ATTN_ARGS="--heads 4,2,32 --dtype float32 --blocks 64 --repeats 1",
    )
    proc = subprocess.run(
        ["bash", "bench/gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "out" / "table.md").read_text()
    for row in ("| attention 1x256", "blocked_64", "| MoE ", "| capacity |", "(8 devices)", "custom kernel",
                "| moe_impl auto (doctor --moe) |"):  # fmt: skip
        assert row in table, (row, table)
    assert table.count("(no result)") == 3  # the two train runs and vLLM, left out
    assert (tmp_path / "out" / "cache" / "moe_auto.json").is_file()  # auto's choices come back
