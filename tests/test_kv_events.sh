#!/usr/bin/env bash
# KV events (serve --kv-events-config) against `kvsparse serve` on the bundled
# tiny model, read as a router reads them (tests/kv_events/check_events.py,
# Debian's python3-zmq and python3-msgpack): a KV pool of ~3,200 tokens so that
# a few prompts evict.
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BIN="${KVS_BINARY:-$SRC/build/kvsparse}"
PY=/usr/bin/python3
$PY -c 'import zmq, msgpack' || { echo "python3-zmq and python3-msgpack are needed (scripts/install-deps)" >&2; exit 1; }

. "$SRC/tests/serve_tiny.sh"
serve_tiny --kv-memory 0.025 --max-num-seqs 64 --threads 2 \
  --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*","topic":"kv"}'
line=$(grep -m1 "KV events: publishing on" "$SERVE_LOG")
PUB=$(sed -n 's/.*publishing on \(tcp:[^ ,]*\).*/\1/p' <<<"$line")
REPLAY=$(sed -n 's/.*replay on \(tcp:[^ ,]*\).*/\1/p' <<<"$line")
$PY "$SRC/tests/kv_events/check_events.py" "$PORT" "$PUB" "$REPLAY" test-key
kill -TERM "$PID"
wait "$PID" && rc=0 || rc=$?
[ "$rc" -eq 0 ] || { cat "$SERVE_LOG" >&2; echo "the server exited $rc after SIGTERM" >&2; exit 1; }
