#!/usr/bin/env bash
# The official `@anthropic-ai/sdk` npm client (pinned) against `kvsparse serve`
# on the bundled tiny model: /v1/messages whole and streamed, tools, stop
# sequences, count_tokens and the SDK's typed errors (tests/anthropic/*.mjs).
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BIN="${KVS_BINARY:-$SRC/build/kvsparse}"
SDK_VERSION=1.17.0
PREFIX="$SRC/.cache/npm-anthropic"
SDK="$PREFIX/node_modules/@anthropic-ai/sdk"

. "$SRC/tests/npm_client.sh"
npm_client test_server_anthropic @anthropic-ai/sdk "$SDK_VERSION" "$PREFIX"

. "$SRC/tests/serve_tiny.sh"
serve_tiny --served-model-name tiny

fail=0
for t in "$SRC"/tests/anthropic/*.mjs; do
  if KVS_BASE_URL="http://127.0.0.1:$PORT" KVS_MODEL=tiny KVS_API_KEY=test-key \
     ANTHROPIC_MODULE="$SDK/index.mjs" node "$t"; then
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
