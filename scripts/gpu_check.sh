#!/usr/bin/env bash
# Everything a lent GPU should check, in one call, most important first, under one deadline:
#   1. the Pallas kernels: correctness sweep (compiled through Triton) + decode/prefill benchmarks
#   2. greedy parity of the engine, Pallas vs reference (XLA) attention, on random weights of
#      SmolLM2-135M's shape in float32 without TF32 (scripts/gpu_engine.py)
#   3. where a step's time goes, Llama-3.1-8B's shape (scripts/profile_step.py)
#   4. offline throughput on BENCHMARKS.md's log-normal workload: SmolLM2-135M's shape in bfloat16
#      with both backends (and their greedy agreement), then Llama-3.1-8B's shape
# Needs only python3 with jax (+ CUDA), numpy, transformers, tokenizers, tqdm and pyyaml
# (all in the GPU image).
#   scripts/gpu_check.sh              # on the GPU machine
#   scripts/gpu_check.sh --cpu-smoke  # anywhere: interpret-mode kernels + a tiny engine run
# PYTHON=... picks the interpreter (default: python3 if it has jax, else .venv/bin/python).
# DEADLINE=seconds (default 540): stages that would start after it are skipped.
# STAGES="a b": only the named stages (see the list below).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if ! python3 -c "import jax" 2>/dev/null && [ -x .venv/bin/python ]; then
    PYTHON=.venv/bin/python
  fi
fi
OUT=${OUT:-/tmp/gpu_check_out}  # gets two files: summary.txt and logs.txt (few files to copy back from a GPU machine)
LOGS=${LOGS:-/tmp/gpu_check_logs}  # one log per stage
NPZ=${NPZ:-/tmp/gpu_check_npz}  # greedy tokens for the parity stages
mkdir -p "$OUT" "$LOGS" "$NPZ"
rm -f "$LOGS"/*.log "$NPZ"/*.npz
export PYTHONUNBUFFERED=1
# Programs and GEMM autotuning results shared between the stages (each is its own process).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/gpu_check_jaxcache}
START=$SECONDS
DEADLINE=${DEADLINE:-540}
SUMMARY=()
STAGES=${STAGES:-all}  # e.g. STAGES="kernels parity_f32": run only these (a later call's leftovers)
want() { [ "$STAGES" = all ] || [[ " $STAGES " == *" $1 "* ]]; }

stage() {  # stage NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then
    SUMMARY+=("$name: SKIPPED (deadline)"); echo "== $name: skipped, ${left}s left"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s, t=$((SECONDS - START))s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" | grep -v -E "^\s*$|Warning|warn\(" | tail -n 40
  local rc=${PIPESTATUS[0]}
  local res
  res=$(grep -h "^BRIEF " "$LOGS/$name.log" | tail -n 1 | cut -c7-)
  SUMMARY+=("$name: rc=$rc $((SECONDS - t0))s ${res:-$(grep -h -E "ALL PASS|SOME CHECKS FAILED|Error" "$LOGS/$name.log" | tail -n 1)}")
}

if [ "${1:-}" = "--cpu-smoke" ]; then
  stage kernels 300 "$PYTHON" scripts/gpu_check.py --cpu-smoke
  E="$PYTHON scripts/gpu_engine.py --model tiny --backend reference --dtype float32 --num-prompts 8
     --max-num-seqs 8 --max-num-batched-tokens 256 --num-gpu-blocks 800 --num-compare 4"
  stage engine_tiny 300 $E --out "$NPZ/tiny.npz"
else
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv || true
  E="$PYTHON scripts/gpu_engine.py"
  P="--model smollm2-135m --dtype float32 --highest-precision --num-prompts 32 --output-median 64
     --max-num-seqs 32 --max-num-batched-tokens 256 --num-compare 32 --num-gpu-blocks 4096"
  want kernels && stage kernels 170 "$PYTHON" scripts/gpu_check.py
  want smol_f32_pallas && stage smol_f32_pallas 150 $E $P --backend pallas --out "$NPZ/smol_f32_pallas.npz"
  want smol_f32_reference && stage smol_f32_reference 150 $E $P --backend reference --out "$NPZ/smol_f32_reference.npz"
  want parity_f32 && [ -f "$NPZ/smol_f32_pallas.npz" ] && [ -f "$NPZ/smol_f32_reference.npz" ] &&
    stage parity_f32 30 $E --compare "$NPZ/smol_f32_pallas.npz" "$NPZ/smol_f32_reference.npz"
  want profile_llama8b && stage profile_llama8b 150 "$PYTHON" scripts/profile_step.py --random-model llama-3.1-8b \
    --attention-backend pallas --num-prompts 128 --max-num-seqs 128 --max-num-batched-tokens 512
  # The first H200 run: the 135M-shaped stages with the default pool (70 GB, ~190k blocks)
  # ran past 90 s limits (a cold GPU warm-up is ~85 s); a 4096-block pool beside it tells
  # pool size from warm-up.
  want smol_bf16_pallas_4k && stage smol_bf16_pallas_4k 150 $E --model smollm2-135m --backend pallas --num-gpu-blocks 4096 --num-compare 0
  want smol_bf16_pallas && stage smol_bf16_pallas 150 $E --model smollm2-135m --backend pallas --out "$NPZ/smol_bf16_pallas.npz"
  want smol_bf16_reference && stage smol_bf16_reference 150 $E --model smollm2-135m --backend reference --out "$NPZ/smol_bf16_reference.npz"
  want parity_bf16 && [ -f "$NPZ/smol_bf16_pallas.npz" ] && [ -f "$NPZ/smol_bf16_reference.npz" ] &&
    stage parity_bf16 30 $E --compare "$NPZ/smol_bf16_pallas.npz" "$NPZ/smol_bf16_reference.npz"
  want llama8b_bf16_pallas && stage llama8b_bf16_pallas 150 $E --model llama-3.1-8b --backend pallas --num-compare 0
fi
for f in "$LOGS"/*.log; do echo "==== $(basename "$f")"; cat "$f"; done >"$OUT/logs.txt"
{ echo; echo "== summary ($((SECONDS - START))s)"; printf '%s\n' "${SUMMARY[@]}"; } | tee "$OUT/summary.txt"
