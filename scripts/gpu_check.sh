#!/usr/bin/env bash
# Everything a lent GPU should check, in ONE call, most important first, each stage under
# its own time limit inside one deadline (DEADLINE, default 540 s); writes $OUT/summary.txt (one line
# per check) and $OUT/logs.txt (every stage's log).
#   a  parity          engine greedy parity, Pallas vs XLA attention, float32 without TF32, 32 requests,
#                      random weights of SmolLM2-135M's shape (parity_pallas, parity_xla, then parity)
#   b  llama8b         Llama-3.1-8B's shape, random bf16: 1,000 ShareGPT-like requests (medians 200/200)
#                      then the first run's 256-request workload, --async-scheduling when the engine has it;
#                      its warm-up is the COLD warm-up (e), with the compile breakdown
#   c  step8b          decode step B=256 ctx 1k and B=1 vs (weights + KV)/copy bandwidth, routed (decode
#                      kernel) vs ragged, and the in-place KV pool check on the GPU-compiled programs
#      profile8b       the first run's 256 requests timed by step phase (schedule/prepare/model/sample/update)
#   e  llama8b_restart a second process on the same persistent cache: the restart warm-up, then the
#                      1,000 requests with --no-async-scheduling (the host-gap/async comparison), then
#                      `bench batching`'s continuous vs static batching (f)
#   d  kernels         decode vs ragged kernels on decode batches vs copy bandwidth (scripts/gpu_check.py)
#   mla                scripts/gpu_mla.py: the Pallas MLA decode kernel vs the XLA path (correctness), its GB/s
#                      at batch 128, 4k context, 16 and 128 heads, against the latent bytes it reads (FlashMLA: 2,826)
#   host_gap           scripts/bench_host_gap.py at the 8B shape: the device's wait between steps, sync vs async
#   quant              scripts/gpu_quant.py, when present
#   lora               scripts/gpu_lora.py: the LoRA Pallas kernel vs the XLA one-hot path at M = 1, 16, 64
#                      (one Llama-3.1-8B layer's seven projections, 8 adapters of rank 16, bf16)
#   warmup_cost        per-program compile time of the 8B grid on the GPU (scripts/warmup_cost.py)
#   moe30b             Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8), random bf16: output tok/s at 8
#                      and 64 sequences; the grouped matmul kernel vs ragged_dot at decode sizes (scripts/gpu_moe.py)
#   embed_bert         BERT embeddings, random weights of all-MiniLM-L6-v2's and a bge-base-like shape:
#                      requests/s and tokens/s at batch 64 of ~128 tokens, engine and program alone (scripts/gpu_embed.py)
#   deepseek_v2_lite   DeepSeek-V2-Lite's shape (MLA, 64 experts top-6, 2 shared), random bf16: 200 requests of
#                      1,000 in / 100 out, all at t=0 (vLLM PR #10927's workload): req/s, output tok/s, mean TTFT
#                      beside vLLM's 18.5 req/s on an H100 (scripts/gpu_deepseek.py; the MLA decode kernel decodes)
#   qwen25vl_3b        Qwen2.5-VL-3B's shape, random bf16: 100 random-mm prompts (320 text tokens, one image of vLLM's
#                      default buckets, 40 out) at concurrency 10 through AsyncLLM in process (no HTTP server on the
#                      GPU image), max_pixels 1003520; vLLM PR #23119: 5.61 req/s, mean TTFT 1.54 s (scripts/gpu_vl.py)
# The last stages fit no default DEADLINE after the others: run them alone with
#   STAGES="deepseek_v2_lite qwen25vl_3b" DEADLINE=530 scripts/gpu_check.sh   (each 1-4 min, a guess: unmeasured)
# Needs python3 with jax (+ CUDA), numpy, transformers, tokenizers, tqdm, pyyaml, flax (the H200 image has
# them) and three the image lacks, carried as wheels: pydantic (EngineArgs), qwix (quantize-on-load),
# llguidance (structured outputs), with pydantic's own needs. The engine path here imports no gguf,
# starlette or uvicorn. The GPU machine reaches no package index: fetch the wheels here, from the repo root:
#   mkdir -p .git/info .whl && echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 typing_extensions==4.16.0 qwix==0.1.8 llguidance==1.9.1
# and run on the device (carry: [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site || exit; DEADLINE=530 scripts/gpu_check.sh
# Usage:
#   scripts/gpu_check.sh            # on the GPU machine (OUT=$OUT from the device tool)
#   scripts/gpu_check.sh --smoke    # on a CPU: every stage, tiny shapes, Pallas in interpret mode, with
#                                   # gguf/starlette/uvicorn made unimportable (as on the GPU)
# STAGES="a b": only the named stages; DEADLINE=s; PYTHON=interpreter; KEEP_CACHE=1 keeps the compile cache.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if ! python3 -c "import jax" 2>/dev/null && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
fi
SMOKE=0; [ "${1:-}" = "--smoke" ] || [ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
OUT=${OUT:-/tmp/gpu_check_out}
LOGS=${LOGS:-/tmp/gpu_check_logs}
NPZ=${NPZ:-/tmp/gpu_check_npz}
CACHE=${CACHE:-/tmp/gpu_check_jaxcache}  # the engine's persistent compile cache: cold, then the restart's
mkdir -p "$OUT" "$LOGS" "$NPZ"
rm -f "$LOGS"/*.log "$NPZ"/*.npz
[ "${KEEP_CACHE:-0}" = 1 ] || rm -rf "$CACHE"
export PYTHONUNBUFFERED=1
START=$SECONDS
DEADLINE=${DEADLINE:-540}
SUMMARY=()
STAGES=${STAGES:-all}
want() { [ "$STAGES" = all ] || [[ " $STAGES " == *" $1 "* ]]; }

stage() {  # stage NAME LIMIT_S CMD...: every BRIEF line of its log goes to the summary
  local name=$1 limit=$(($2 * SCALE)); shift 2
  want "$name" || return 0
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then
    SUMMARY+=("$name: SKIPPED (deadline)"); echo "== $name: skipped, ${left}s left"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s, t=$((SECONDS - START))s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" | grep -v -E "^\s*$|Warning|warn\(|^RESULT " | tail -n 40
  local rc=${PIPESTATUS[0]} briefs
  briefs=$(grep -h -E "^BRIEF |^host-gap " "$LOGS/$name.log" | sed 's/^BRIEF //')
  [ "$rc" = 124 ] && briefs="${briefs:+$briefs$'\n'}TIMED OUT at ${limit}s; last: $(grep -v '^\s*$' "$LOGS/$name.log" | tail -n 1 | cut -c1-200)"
  [ -z "$briefs" ] && briefs=$(grep -h -E "ALL PASS|SOME CHECKS FAILED|Error|error" "$LOGS/$name.log" | tail -n 1 | cut -c1-300)
  while IFS= read -r line; do SUMMARY+=("$name: rc=$rc $((SECONDS - t0))s $line"); done <<< "$briefs"
  # As it goes, so a run cut short by the device's own limit still brings back what it measured.
  printf '%s\n' "${SUMMARY[@]}" >"$OUT/summary.txt"
  for f in "$LOGS"/*.log; do echo "==== $(basename "$f")"; cat "$f"; done >"$OUT/logs.txt"
}

E="$PYTHON scripts/gpu_engine.py --compilation-cache-dir $CACHE"
SCALE=${SCALE:-}  # stage limits x SCALE (smoke: 8)
if [ "$SMOKE" = 1 ]; then  # tiny shapes; the packages absent from the GPU image (and not carried) made unimportable
  BLOCK=$(mktemp -d)
  for m in gguf starlette uvicorn; do
    mkdir -p "$BLOCK/$m" && echo "raise ImportError('$m is not in the GPU image')" >"$BLOCK/$m/__init__.py"
  done
  export PYTHONPATH="$BLOCK:$PWD"
  SCALE=${SCALE:-8}  # a busy 2-core CPU compiles a tiny engine's warm-up in 20-70 s
  SMALL="--model tiny"; BIG="--model tiny --dtype float32"; PALLAS=pallas-interpret
  PAR="--num-prompts 8 --max-num-seqs 8 --max-num-batched-tokens 64 --num-gpu-blocks 256"
  BIGRUN="--workloads custom --num-prompts 16 --max-num-seqs 16 --max-num-batched-tokens 64 --num-gpu-blocks 512"
  STEP="--model tiny --dtype float32 --batches 4 1 --context 64 --reps 2 --copy-bytes 4194304"
  PROF="--random-model tiny --dtype float32 --num-prompts 16 --max-num-seqs 16 --max-num-batched-tokens 64"
  GAP="--random-model tiny --dtype float32 --num-seqs 16 --steps 5"
  KERN="--cpu-smoke"; COST="--model tiny --limit 1 --max-num-seqs 8 --max-num-batched-tokens 64"
else
  SCALE=${SCALE:-1}
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv || true
  SMALL="--model smollm2-135m"; BIG="--model llama-3.1-8b --dtype bfloat16"; PALLAS=pallas
  PAR="--num-prompts 32 --output-median 64 --max-num-seqs 32 --max-num-batched-tokens 128 --num-gpu-blocks 4096"
  BIGRUN="--max-num-seqs 256 --max-num-batched-tokens 2048 --gpu-memory-utilization 0.5"
  STEP="--model llama-3.1-8b --batches 256 1 --context 1024 --reps 20"
  PROF="--random-model llama-3.1-8b --dtype bfloat16 --attention-backend pallas --num-prompts 256
        --max-num-seqs 256 --max-num-batched-tokens 2048 --gpu-memory-utilization 0.5"
  GAP="--random-model llama-3.1-8b --dtype bfloat16 --num-seqs 256 --steps 30 --max-model-len 1024"
  KERN="--skip-sweep"; COST="--model llama-3.1-8b --limit 2"
fi
F32="$SMALL --dtype float32 --highest-precision $PAR --num-compare 32 --workloads custom"
# (a) Parity. GEMM autotuning off for these two: it changes no result here (IEEE float32), only time.
stage parity_pallas 75 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  $E $F32 --backend $PALLAS --out "$NPZ/f32_pallas.npz"
stage parity_xla 75 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  $E $F32 --backend xla --out "$NPZ/f32_xla.npz"
[ -f "$NPZ/f32_pallas.npz" ] && [ -f "$NPZ/f32_xla.npz" ] &&
  stage parity 20 $E --compare "$NPZ/f32_pallas.npz" "$NPZ/f32_xla.npz"
# (b) + cold warm-up (e). The workloads' names pick their own request counts and lengths.
W1="sharegpt1000 first256"; W2="sharegpt1000 batching"
[ "$SMOKE" = 1 ] && W1=custom && W2="custom batching"
stage llama8b 200 $E $BIG --backend $PALLAS $BIGRUN --workloads $W1 --num-compare 0 --async-scheduling
# (c) one decode step against the hardware, and the in-place check on the GPU-compiled programs
stage step8b 90 "$PYTHON" scripts/gpu_step.py $STEP --backend $PALLAS
# The quantized matmuls against bf16 (W4A16 kernel at M = 1, 16, 64; the fp8 dot), when that script has landed
[ -f scripts/gpu_quant.py ] && stage quant 60 "$PYTHON" scripts/gpu_quant.py $([ "$SMOKE" = 1 ] && echo --cpu-smoke)
# The LoRA shrink/expand kernel against the XLA one-hot product (Llama-3.1-8B's projections, rank 16, 8 adapters)
stage lora 60 "$PYTHON" scripts/gpu_lora.py $([ "$SMOKE" = 1 ] && echo --cpu-smoke)
# update_weights in process (issue 48), random weights, against one copy of the bytes (targets: < 0.18 s at
# Qwen3-0.6B, TRL's figure on an H100; < 0.5 s at Llama-3.1-8B)
UPD="--dtype bfloat16 --skip-numpy"; [ "$SMOKE" = 1 ] && UPD="--dtype float32 --reps 2"
stage update06b 60 "$PYTHON" scripts/bench_update_weights.py $UPD --model $([ "$SMOKE" = 1 ] && echo tiny || echo qwen3-0.6b)
stage update8b 90 "$PYTHON" scripts/bench_update_weights.py $UPD --model $([ "$SMOKE" = 1 ] && echo tiny || echo llama-3.1-8b)
# (e) restart on the same cache, the other scheduling mode, then (f)
stage llama8b_restart 150 $E $BIG --backend $PALLAS $BIGRUN --workloads $W2 --num-compare 0 --no-async-scheduling
# FP8 weights (quantized on load, e4m3 per output channel, dynamic per-token activations) on the 1,000 requests
W3=sharegpt1000; [ "$SMOKE" = 1 ] && W3=custom
stage llama8b_fp8 150 $E $BIG --backend $PALLAS $BIGRUN --workloads $W3 --num-compare 0 --async-scheduling \
  --quantization fp8
# (d) the kernels alone
stage kernels 60 "$PYTHON" scripts/gpu_check.py $KERN
# The MLA decode kernel (DeepSeek's latent pool) against the XLA path, and its GB/s at batch 128, 4k context
stage mla 60 "$PYTHON" scripts/gpu_mla.py $([ "$SMOKE" = 1 ] && echo --cpu-smoke)
# Where a step's time goes, host phases vs device (same engine shape and cache as llama8b: no compiles)
stage profile8b 75 "$PYTHON" scripts/profile_step.py $PROF --compilation-cache-dir "$CACHE"
# The device's wait between two steps at 256 decoding sequences, sync vs async
[ -f scripts/bench_host_gap.py ] && stage host_gap 90 "$PYTHON" scripts/bench_host_gap.py $GAP
stage moe30b 240 "$PYTHON" scripts/gpu_moe.py $([ "$SMOKE" = 1 ] && echo --cpu-smoke) --compilation-cache-dir "$CACHE"
stage embed_bert 120 "$PYTHON" scripts/gpu_embed.py --compilation-cache-dir "$CACHE" $([ "$SMOKE" = 1 ] && echo --cpu-smoke)
stage warmup_cost 45 env -u JAX_COMPILATION_CACHE_DIR "$PYTHON" scripts/warmup_cost.py $COST \
  --backend $([ "$SMOKE" = 1 ] && echo pallas-interpret || echo pallas)
# DeepSeek-V2-Lite's shape at vLLM PR #10927's 1000 in / 100 out; Qwen2.5-VL-3B's at PR #23119's random-mm (conc. 10)
stage deepseek_v2_lite 240 "$PYTHON" scripts/gpu_deepseek.py $([ "$SMOKE" = 1 ] && echo --cpu-smoke) \
  --compilation-cache-dir "$CACHE"
stage qwen25vl_3b 240 "$PYTHON" scripts/gpu_vl.py $([ "$SMOKE" = 1 ] && echo --cpu-smoke) \
  --compilation-cache-dir "$CACHE"
for f in "$LOGS"/*.log; do echo "==== $(basename "$f")"; cat "$f"; done >"$OUT/logs.txt"
{ echo "== summary ($((SECONDS - START))s, $(date -u +%FT%TZ))"; printf '%s\n' "${SUMMARY[@]}"; } | tee "$OUT/summary.txt"
