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

# exit 77 (ctest: skipped, SKIP_RETURN_CODE) when the client cannot be had here
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "test_server_anthropic: needs node and npm (scripts/install-deps installs them): skipped" >&2
  exit 77
fi
if [ "$(node -p "try{require('$SDK/package.json').version}catch(e){''}")" != "$SDK_VERSION" ]; then
  mkdir -p "$PREFIX"
  if ! npm install --prefix "$PREFIX" --no-audit --no-fund --silent "@anthropic-ai/sdk@$SDK_VERSION" >&2; then
    echo "test_server_anthropic: needs @anthropic-ai/sdk@$SDK_VERSION (npm install failed: offline?): skipped" >&2
    exit 77
  fi
fi

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
