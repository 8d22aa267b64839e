#!/usr/bin/env bash
# The official `openai` npm client (pinned) against `kvsparse serve` on the
# bundled tiny model: completions, chat and responses (tests/openai/*.mjs),
# streaming and not, usage, stops, tools.
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BIN="${KVS_BINARY:-$SRC/build/kvsparse}"
OPENAI_VERSION=5.12.0
PREFIX="$SRC/.cache/npm-openai"

# exit 77 (ctest: skipped, SKIP_RETURN_CODE) when the client cannot be had here
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "test_server_openai: needs node and npm (scripts/install-deps installs them): skipped" >&2
  exit 77
fi
if [ "$(node -p "try{require('$PREFIX/node_modules/openai/package.json').version}catch(e){''}")" != "$OPENAI_VERSION" ]; then
  mkdir -p "$PREFIX"
  if ! npm install --prefix "$PREFIX" --no-audit --no-fund --silent "openai@$OPENAI_VERSION" >&2; then
    echo "test_server_openai: needs the openai@$OPENAI_VERSION npm package (npm install failed: offline?): skipped" >&2
    exit 77
  fi
fi

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
