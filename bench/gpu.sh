#!/usr/bin/env bash
# Every benchmark of bench/ on one lent GPU, in under 10 minutes (each step has its own timeout;
# they add up to 765 s; typical runs take less). Run from the repository root; results go to $OUT
# (default ./gpu_out), ending with one markdown table for bench/RESULTS.md (bench/gpu_table.py).
#   bash bench/gpu.sh            # on the GPU machine (ROCm or CUDA jax installed)
#   PLUMBING=1 bash bench/gpu.sh # the CPU plumbing check: tiny sizes, 8 fake devices (every step: 3.5 min on
#                                # a 2-core CPU; CI's tests/test_gpu_script.py leaves out, with SKIP, the
#                                # steps other tests cover: build hf muon checkpoint data decoding small small_4k)
# 1. zaya doctor --require-gpu (refuses a silent CPU fallback) and its MoE timings (doctor --moe);
# 2. training step vs HF transformers (PyTorch on the same GPU when it sees one), MFU against the
#    datasheet peak (`small` preset shapes, float32 so both frameworks compute the same thing);
# 3. Muon+AdamW vs AdamW; 4. checkpoint save/restore vs raw I/O, and distributed saves (the
#    host's CPU devices: one GPU holds one process); 5. data pipeline vs step
#    consumption; 6. cached decoding vs recomputing; 7. custom-call kernels vs XLA;
# 8. every attention implementation (dense, blocked, pallas, cuDNN) at 4k/8k/32k, ZAYA1-8B's heads
#    (8 q / 2 kv of 128), bf16, forward + backward; 9. every MoE path at ZAYA1-8B's expert shapes
#    (16 experts, hidden 2048, moe_intermediate_size 2048, top-1), bf16; 10. collective bus bandwidth;
# 11. `zaya train` of the `small` preset, bf16, at 2k and 4k tokens per row: tokens/s and MFU with
#    moe_impl auto's choice (its cache is kept under $OUT/cache); 12. vLLM given the quantized
#    expert exports (bench/vllm_quantized.py: served, or what it refused); 13. the table.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # packages the GPU image lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
export ZAYA_CACHE_DIR=${ZAYA_CACHE_DIR:-$OUT/cache}  # moe_impl auto's choices and the XLA cache come back
if [ "${PLUMBING:-0}" = 1 ]; then  # tiny sizes on CPU: every step runs, nothing is a speed
  : "${CONFIG:=tiny}" "${SEQ:=128}" "${TOKENS:=1024}" "${CKPT_MIB:=16}" "${REQUIRE_GPU:=0}" "${SEQ4K:=256}"
  : "${ATTN_SHAPES:=1x256 1x512}" "${ATTN_ARGS:=--heads 4,2,32 --dtype float32 --blocks 64 --pallas --repeats 1}"
  : "${MOE_ARGS:=--tokens 512 --hidden 64 --inner 64 --experts 4 --dtype float32 --rounds 1}"
  : "${COLLECTIVE_ARGS:=--mib 0.25 --dtype float32 --rounds 2}" "${STEPS:=4}" "${SMALL_BATCH:=4}"
  : "${COLLECTIVE_DEVICES:=8}" "${BUILD_GPU:=none}" "${KERNEL_ARGS:=--small --repeats 1}"
  : "${TVH_ARGS:=--batch 2 --rounds 1 --steps 1 --warmup 1 --optimizers adamw --no-dense}"
  : "${MUON_ARGS:=--repeats 1}" "${DATA_ARGS:=--batches 5 --prepared-mib 1}" "${DECODE_ARGS:=--batch 2 --prompt 32 --new 8}"
fi
CONFIG=${CONFIG:-small}; SEQ=${SEQ:-1024}; TOKENS=${TOKENS:-65536}; CKPT_MIB=${CKPT_MIB:-2048}
STEPS=${STEPS:-30}; SMALL_BATCH=${SMALL_BATCH:-16}
REQUIRE=--require-gpu; [ "${REQUIRE_GPU:-1}" = 0 ] && REQUIRE=
start=$SECONDS
step() { echo "== $1 ($((SECONDS - start)) s)"; }
want() { [[ " ${SKIP:-} " != *" $1 "* ]]; }  # SKIP="hf muon ...": steps left out (the CI plumbing check)

step doctor
timeout 20 python3 -m zaya_jax.cli doctor --json $REQUIRE > "$OUT/doctor.json" 2>&1 || {
  cat "$OUT/doctor.json"; echo "no GPU visible to JAX: stopping"; exit 1; }
timeout 30 python3 -m zaya_jax.cli doctor --moe --json --config $CONFIG > "$OUT/doctor_moe.json" 2>&1
tail -6 "$OUT/doctor_moe.json"
if want build; then
step "custom-call kernels (build)"
timeout 40 python3 custom_calls/build.py --gpu ${BUILD_GPU:-auto} 2>&1 | tail -2
fi
if want hf; then
step "train step vs HF and dense"
timeout 80 python3 bench/train_vs_hf.py --config $CONFIG --seq $SEQ --impls sorted --set model.dtype=float32 \
  ${TVH_ARGS:---batch 8 --rounds 4 --steps 2} 2>&1 | tee "$OUT/train_vs_hf.json" | tail -30
fi
if want muon; then
step "Muon vs AdamW"
timeout 40 python3 bench/muon_vs_adamw.py --config $CONFIG --tokens $TOKENS ${MUON_ARGS:---repeats 5} \
  2>&1 | tee "$OUT/muon_vs_adamw.json" | tail -20
fi
if want checkpoint; then
step "checkpoint vs raw I/O"
timeout 25 python3 bench/checkpoint_speed.py --mib $CKPT_MIB --dir /tmp/zaya_ckpt_bench \
  2>&1 | tee "$OUT/checkpoint_speed.json" | tail -20
step "distributed save: every process its shards vs one gathering (2 processes x 4 CPU devices, this host's disks)"
JAX_PLATFORMS=cpu timeout 30 python3 bench/distributed_save.py --mib $((CKPT_MIB / 2)) --rounds 2 \
  2>&1 | tee "$OUT/distributed_save.txt" | tail -8
fi
if want data; then
step "data pipeline vs consumption"
timeout 25 python3 bench/data_pipeline.py --config $CONFIG ${DATA_ARGS:---batches 50 --prepared-mib 8} 2>&1 \
  | tee "$OUT/data_pipeline.json" | tail -20
fi
if want decoding; then
step "decoding"
timeout 20 python3 bench/generate_speed.py --config $CONFIG ${DECODE_ARGS:---batch 8 --prompt 256 --new 128} \
  2>&1 | tee "$OUT/generate.json" | tail -14
step "rollout engine vs the static sampler and HF generate (RL-shaped workload)"
timeout 40 python3 bench/engine.py --config $CONFIG --rounds 1 ${ENGINE_ARGS:---prompts 32 --group 8 --slots 64} \
  2>&1 | tee "$OUT/engine.md" | tail -8
fi
if want kernels; then
step "kernels vs XLA"
timeout 25 python3 bench/kernels.py ${KERNEL_ARGS:---repeats 5} 2>&1 | tee "$OUT/kernels.json" | tail -3
fi
step "attention: dense, blocked, pallas, cuDNN (bf16, 8/2 heads of 128) at 4k, 8k, 32k"
timeout 75 python3 bench/attention.py --shapes ${ATTN_SHAPES:-2x4096 1x8192 1x32768} \
  ${ATTN_ARGS:---blocks 128 256 --heads 8,2,128 --dtype bfloat16 --repeats 5} 2>&1 | tee "$OUT/attention.json" | tail -3
step "MoE paths at ZAYA1-8B's expert shapes (bf16)"
timeout 45 python3 bench/moe_paths.py ${MOE_ARGS:---tokens 8192} 2>&1 | tee "$OUT/moe_paths.json" | tail -12
step "collectives: bus bandwidth"
fake=; [ -n "${COLLECTIVE_DEVICES:-}" ] && fake="--xla_force_host_platform_device_count=$COLLECTIVE_DEVICES"
XLA_FLAGS="${XLA_FLAGS:-} $fake" timeout 20 python3 bench/collectives.py ${COLLECTIVE_ARGS:---mib 1 16 256} 2>&1 \
  | tee "$OUT/collectives.json" | tail -3
for run in "small 2048 70" "small_4k ${SEQ4K:-4096} 60"; do
  set -- $run
  want "$1" || continue
  step "zaya train ($CONFIG, bf16) at $2 tokens per row: tokens/s and MFU, moe_impl auto"
  rows=$SMALL_BATCH; [ "$1" = small_4k ] && rows=$((SMALL_BATCH / 2))
  seq=$2; [ "${PLUMBING:-0}" = 1 ] && [ "$1" = small ] && seq=$SEQ
  timeout "$3" python3 -m zaya_jax.cli train --config $CONFIG run.dir=/tmp/gpu_$1_$$ train.steps=$STEPS \
    log.every=$((STEPS / 3 > 0 ? STEPS / 3 : 1)) eval.every=1000 eval.batches=1 train.seq_len=$seq \
    train.batch_size=$rows train.micro_batches=2 model.moe_impl=auto --no-progress 2>&1 | tail -3
  cp /tmp/gpu_$1_$$/metrics.jsonl "$OUT/$1_metrics.jsonl" 2>/dev/null
  cp /tmp/gpu_$1_$$/events.jsonl "$OUT/$1_events.jsonl" 2>/dev/null
done
if want vllm; then
step "vLLM: zaya's fp8-experts and mxfp4-experts exports"
timeout 120 python3 bench/vllm_quantized.py --out /tmp/vllm_quantized_$$ 2>&1 | tee "$OUT/vllm_quantized.jsonl" | tail -2
fi
step table
python3 bench/gpu_table.py "$OUT" | tee "$OUT/table.md"
step done
