#!/usr/bin/env bash
# Seconds from launching `jaxserve serve FLAGS...` until /v1/models answers 200 (polled every
# 0.2 s), REPEAT times (default 3), each a fresh process; the first run of a new flag set
# fills the persistent compilation cache (a cold start), the later ones are restarts.
#   scripts/serve_ready.sh --quantization int8 --kv-cache-dtype bfloat16 --block-size 64
#   REPEAT=2 PORT=8200 scripts/serve_ready.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8123}
REPEAT=${REPEAT:-3}
LOG=${LOG:-/tmp/serve_ready.log}
for _ in $(seq "$REPEAT"); do
  start=$(date +%s.%N)
  .venv/bin/jaxserve serve --port "$PORT" "$@" >"$LOG" 2>&1 &
  pid=$!
  ready=""
  for _ in $(seq 3000); do  # 10 minutes at most
    if ! kill -0 "$pid" 2>/dev/null; then echo "the server exited; see $LOG"; exit 1; fi
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$PORT/v1/models")" = 200 ]; then
      ready=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)")
      break
    fi
    sleep 0.2
  done
  echo "ready in ${ready:-(not within 10 minutes)} s"
  kill "$pid"; wait "$pid" 2>/dev/null
done
