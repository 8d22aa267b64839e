#!/usr/bin/env bash
# Three `kvsparse serve` replicas on loopback behind an event-driven router
# (tests/kv_events/route_replicas.py): 40 two-turn conversations routed by the
# replicas' KV events against round robin; the turn-2 prefix-cache hit rate of both.
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BIN="${KVS_BINARY:-$SRC/build/kvsparse}"
PY=/usr/bin/python3
$PY -c 'import zmq, msgpack' || { echo "python3-zmq and python3-msgpack are needed (scripts/install-deps)" >&2; exit 1; }

. "$SRC/tests/serve_tiny.sh"
EVENTS='{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","topic":"kv"}'
replicas=()
pids=()
logs=()
for i in 1 2 3; do
  serve_tiny --threads 1 --kv-events-config "$EVENTS"
  trap - EXIT  # serve_tiny's trap stops one server: all are stopped below
  pids+=("$PID")
  logs+=("$SERVE_LOG")
  pub=$(sed -n 's/.*KV events: publishing on \(tcp:[^ ,]*\).*/\1/p' "$SERVE_LOG" | head -1)
  replicas+=("$PORT:$pub")
done
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
rc=0
$PY "$SRC/tests/kv_events/route_replicas.py" test-key "${replicas[@]}" || rc=$?
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p" || { echo "a replica exited non-zero after SIGTERM" >&2; rc=1; }; done
trap - EXIT
exit $rc
