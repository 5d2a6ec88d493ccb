#!/usr/bin/env bash
# Time every stop path of `pdserve serve` on an idle server: for each mode (colocated, pd) and
# signal (SIGINT to the main process, SIGTERM to it, SIGTERM to its process group), start the
# server in its own session, wait for /health, send the signal and time until no process of
# that session is left. Only the processes this script started are signalled.
#   scripts/stop_times.sh [MODEL]     (default: the tiny test model, made on first use)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
MODEL=${1:-}
if [ -z "$MODEL" ]; then
  MODEL=$(mktemp -d)/tiny
  .venv/bin/pdserve make-model --preset tiny "$MODEL" >/dev/null 2>&1
fi
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
LOG=$(mktemp)
for mode in colocated pd; do
  for how in INT TERM GROUP; do
    setsid .venv/bin/pdserve serve --model "$MODEL" --port "$PORT" --host 127.0.0.1 --mode "$mode" >"$LOG" 2>&1 &
    pid=$!
    for _ in $(seq 960); do curl -sf -o /dev/null "http://127.0.0.1:$PORT/health" && break; sleep 0.25; done
    n=$(ps -eo sess= | grep -cw "$pid")
    t0=$(date +%s.%N)
    case $how in INT) kill -INT "$pid" ;; TERM) kill -TERM "$pid" ;; GROUP) kill -TERM -- "-$pid" ;; esac
    rc=0; wait "$pid" || rc=$?
    while ps -eo sess= | grep -qw "$pid"; do sleep 0.05; done
    echo "$mode $how processes=$n exit=$rc all gone after $(echo "$(date +%s.%N) - $t0" | bc) s"
  done
done
rm -f "$LOG"
