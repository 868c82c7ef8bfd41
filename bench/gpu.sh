#!/usr/bin/env bash
# Every benchmark of bench/ on one lent GPU, in under 10 minutes (each step has its own timeout;
# they add up to 560 s; typical runs take less). Run from the repository root; results go to $OUT (default ./gpu_out).
#   bash bench/gpu.sh            # on the GPU machine (ROCm or CUDA jax installed)
#   CONFIG=tiny SEQ=128 TOKENS="1024 8192" CKPT_MIB=64 REQUIRE_GPU=0 bash bench/gpu.sh   # plumbing check on a CPU
# 1. zaya doctor --require-gpu (refuses a silent CPU fallback);
# 2. training step vs HF transformers (PyTorch on the same GPU when it sees one) and a dense model
#    of equal active size, with MFU against the datasheet peak (`small` preset shapes, float32
#    so both frameworks compute the same thing);
# 3. Muon+AdamW vs AdamW at 64k tokens per step; 4. checkpoint save/restore vs raw I/O;
# 5. data pipeline vs step consumption; 6. cached decoding vs recomputing; 7. custom-call kernels
#    vs XLA; 8. a short bf16 `zaya train` of the `small` preset for its logged tokens/s and MFU;
# 9. the blocked attention kernel vs the dense definition and jax.nn.dot_product_attention (cuDNN),
#    ZAYA1-8B's heads (8 q / 2 kv of 128), bf16, forward + backward, 4k and 8k tokens;
# 10. the `small` train step at 4k tokens per row (blocked attention, chunked loss): tokens/s and MFU.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # packages the GPU image lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
CONFIG=${CONFIG:-small}; SEQ=${SEQ:-1024}; TOKENS=${TOKENS:-65536}; CKPT_MIB=${CKPT_MIB:-2048}
REQUIRE=--require-gpu; [ "${REQUIRE_GPU:-1}" = 0 ] && REQUIRE=
start=$SECONDS
step() { echo "== $1 ($((SECONDS - start)) s)"; }

step doctor
timeout 20 python3 -m zaya_jax.cli doctor --json $REQUIRE > "$OUT/doctor.json" 2>&1 || {
  cat "$OUT/doctor.json"; echo "no GPU visible to JAX: stopping"; exit 1; }
step "custom-call kernels (build)"
timeout 40 python3 custom_calls/build.py --gpu auto 2>&1 | tail -2
step "train step vs HF and dense"
timeout 100 python3 bench/train_vs_hf.py --config $CONFIG --batch 8 --seq $SEQ --rounds 4 --steps 2 --impls sorted \
  --set model.dtype=float32 2>&1 | tee "$OUT/train_vs_hf.json" | tail -30
step "Muon vs AdamW"
timeout 60 python3 bench/muon_vs_adamw.py --config $CONFIG --tokens $TOKENS --repeats 5 \
  2>&1 | tee "$OUT/muon_vs_adamw.json" | tail -20
step "checkpoint vs raw I/O"
timeout 30 python3 bench/checkpoint_speed.py --mib $CKPT_MIB --dir /tmp/zaya_ckpt_bench \
  2>&1 | tee "$OUT/checkpoint_speed.json" | tail -20
step "data pipeline vs consumption"
timeout 30 python3 bench/data_pipeline.py --config $CONFIG --batches 50 --prepared-mib 8 2>&1 | tee "$OUT/data_pipeline.json" | tail -20
step "decoding"
timeout 40 python3 bench/generate_speed.py --config $CONFIG --batch 8 --prompt 256 --new 128 \
  2>&1 | tee "$OUT/generate.json" | tail -14
step "kernels vs XLA"
timeout 30 python3 bench/kernels.py --repeats 5 2>&1 | tee "$OUT/kernels.json" | tail -12
step "zaya train (small, bf16): tokens/s and MFU"
timeout 80 python3 -m zaya_jax.cli train --config $CONFIG run.dir=/tmp/gpu_run_$$ train.steps=30 log.every=10 \
  eval.every=1000 eval.batches=1 train.batch_size=16 train.micro_batches=4 --no-progress 2>&1 | tail -5
cp /tmp/gpu_run_$$/metrics.jsonl "$OUT/small_metrics.jsonl" 2>/dev/null
grep tokens_per_s /tmp/gpu_run_$$/metrics.jsonl | tail -2
step "attention: blocked vs dense vs cuDNN (bf16, 8/2 heads of 128)"
timeout 60 python3 bench/attention.py --shapes ${ATTN_SHAPES:-4x1024 2x4096 1x8192} --blocks 128 256 512 \
  --heads 8,2,128 --dtype bfloat16 --repeats 5 2>&1 | tee "$OUT/attention.json" | tail -40
step "zaya train (small, bf16) at 4k tokens per row: tokens/s and MFU"
timeout 70 python3 -m zaya_jax.cli train --config $CONFIG run.dir=/tmp/gpu_run4k_$$ train.steps=20 log.every=5 \
  eval.every=1000 eval.batches=1 train.seq_len=${SEQ4K:-4096} train.batch_size=8 train.micro_batches=2 \
  --no-progress 2>&1 | tail -5
cp /tmp/gpu_run4k_$$/metrics.jsonl "$OUT/small_4k_metrics.jsonl" 2>/dev/null
grep tokens_per_s /tmp/gpu_run4k_$$/metrics.jsonl | tail -2
step done
