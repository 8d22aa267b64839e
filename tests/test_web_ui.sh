#!/usr/bin/env bash
# The chat page of `kvsparse serve` (GET /) in headless Chromium, driven by the
# pinned puppeteer-core (tests/web/chat.mjs) on the bundled model with an API
# key: the page asks for the key, sends a message with a sparse kv_policy, and
# the streamed answer and its KV panel show; the latest panel stays in view
# (1280x800 and 1280x600); Stop and New chat work; the screenshot is saved as
# $KVS_SCREENSHOT (default: web-ui.png in the build folder; docs/img/web-ui.png
# is one). Chromium comes from Debian (scripts/install-browser); skipped (77)
# only when it or the npm package cannot be had here.
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BIN="${KVS_BINARY:-$SRC/build/kvsparse}"
PUPPETEER_VERSION=24.43.1
PREFIX="$SRC/.cache/npm-puppeteer"
SHOT="${KVS_SCREENSHOT:-$(dirname "$BIN")/web-ui.png}"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "test_web_ui: needs node and npm (scripts/install-deps installs them): skipped" >&2
  exit 77
fi
if ! CHROMIUM=$("$SRC/scripts/install-browser"); then
  echo "test_web_ui: needs Chromium (Debian's chromium-headless-shell; scripts/install-browser could not install it): skipped" >&2
  exit 77
fi
if [ "$(node -p "try{require('$PREFIX/node_modules/puppeteer-core/package.json').version}catch(e){''}")" != "$PUPPETEER_VERSION" ]; then
  mkdir -p "$PREFIX"
  if ! PUPPETEER_SKIP_DOWNLOAD=1 npm install --prefix "$PREFIX" --no-audit --no-fund --silent \
       "puppeteer-core@$PUPPETEER_VERSION" >&2; then
    echo "test_web_ui: needs the puppeteer-core@$PUPPETEER_VERSION npm package (npm install failed: offline?): skipped" >&2
    exit 77
  fi
fi

. "$SRC/tests/serve_tiny.sh"
serve_tiny

if KVS_URL="http://127.0.0.1:$PORT/" KVS_API_KEY=test-key KVS_CHROMIUM="$CHROMIUM" KVS_SCREENSHOT="$SHOT" \
   PUPPETEER_MODULE="$PREFIX/node_modules/puppeteer-core/lib/esm/puppeteer/puppeteer-core.js" \
   node "$SRC/tests/web/chat.mjs"; then
  echo "PASS chat page (screenshot: $SHOT)"
else
  echo "FAIL chat page; the server's log:"; cat "$SERVE_LOG"
  exit 1
fi
