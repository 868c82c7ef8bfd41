#!/usr/bin/env bash
# One-shot GPU check for a lent NVIDIA machine (run from the repository root; no network there).
# 1. model, MoE, packing and decoding tests on the GPU (float32 at full matmul precision, so the
#    1e-4 HF parity bound is meaningful: TF32 would not meet it); 2. a short bf16 training run of
#    the `small` preset reporting tokens/s and MFU; 3. cached decoding vs recomputing the forward.
# Results are written under $OUT (or ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # packages the GPU image lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import jax, flax, optax; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__)" 2>&1 | tee "$OUT/versions.txt"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/model/test_hf_parity.py tests/model/test_experts.py tests/model/test_packing.py \
  tests/eval/test_generate.py -k "not trained_run" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -8
timeout 150 python3 -m zaya_jax.cli train --config small run.dir=/tmp/gpu_run train.steps=40 log.every=10 \
  eval.every=1000 eval.batches=1 train.batch_size=16 train.micro_batches=4 --no-progress 2>&1 | tail -12
cp /tmp/gpu_run/metrics.jsonl "$OUT/small_metrics.jsonl" 2>/dev/null
grep tokens_per_s /tmp/gpu_run/metrics.jsonl | tail -2
timeout 90 python3 bench/generate_speed.py --config small --batch 8 --prompt 256 --new 128 2>&1 | tee "$OUT/generate.txt" | tail -14
# 4. custom-call kernels: build the CUDA library from custom_calls/gpu/kernels.cu, check it against
#    the references on the GPU (the same tests as the CPU twins) and time it against XLA.
timeout 120 python3 custom_calls/build.py --gpu cuda 2>&1 | tail -3
python3 -m zaya_jax.cli doctor --json 2>&1 | tee "$OUT/doctor.json" | tail -12
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/ops/test_kernels.py 2>&1 | tee "$OUT/gpu_kernel_tests.txt" | tail -5
timeout 120 python3 bench/kernels.py --repeats 5 2>&1 | tee "$OUT/kernels.json" | tail -2
