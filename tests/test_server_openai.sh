#!/usr/bin/env bash
# The official `openai` npm client (pinned) against `kvsparse serve` on the
# bundled tiny model: completions, chat and responses (tests/openai/*.mjs),
# streaming and not, usage, stops, tools.
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BIN="${KVS_BINARY:-$SRC/build/kvsparse}"
OPENAI_VERSION=5.12.0
PREFIX="$SRC/.cache/npm-openai"

. "$SRC/tests/npm_client.sh"
npm_client test_server_openai openai "$OPENAI_VERSION" "$PREFIX"

. "$SRC/tests/serve_tiny.sh"
serve_tiny --served-model-name tiny

fail=0
for t in "$SRC"/tests/openai/*.mjs; do
  if NODE_PATH="$PREFIX/node_modules" KVS_URL="http://127.0.0.1:$PORT/v1" KVS_MODEL=tiny KVS_API_KEY=test-key \
     OPENAI_MODULE="$PREFIX/node_modules/openai/index.mjs" node "$t"; then
    echo "PASS $(basename "$t")"
  else
    echo "FAIL $(basename "$t")"
    fail=1
  fi
done
kill -TERM "$PID"
wait "$PID" && rc=0 || rc=$?
[ "$rc" -eq 0 ] || { echo "the server exited $rc after SIGTERM" >&2; fail=1; }
exit $fail
