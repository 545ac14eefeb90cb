#!/usr/bin/env bash
# Correctness sweep (compiled) + decode/ragged benchmarks of pallas_kernels on a GPU.
# Needs only python3 with jax (+ CUDA) and numpy. Without a GPU, or with
# --cpu-smoke, it runs in Pallas interpret mode with tiny shapes.
#   scripts/gpu_check.sh              # on the GPU machine
#   scripts/gpu_check.sh --cpu-smoke  # anywhere
# PYTHON=... picks the interpreter (default: python3 if it has jax, else .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if ! python3 -c "import jax" 2>/dev/null && [ -x .venv/bin/python ]; then
    PYTHON=.venv/bin/python
  fi
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
