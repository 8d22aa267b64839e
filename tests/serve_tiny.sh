# Sourced by the shell tests that drive `kvsparse serve` from a client: starts it
# on the bundled model on a free port with the API key test-key (and any extra
# arguments), sets PID and PORT, and stops it on exit. Needs SRC and BIN set.
serve_tiny() {
  SERVE_LOG=$(mktemp)
  SERVE_OUT=$(mktemp)
  OMP_WAIT_POLICY=passive "$BIN" serve -m "$SRC/models/tiny-needle-llama" --port 0 --api-key test-key "$@" \
    >"$SERVE_OUT" 2>"$SERVE_LOG" &
  PID=$!
  trap 'kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; rm -f "$SERVE_LOG" "$SERVE_OUT"' EXIT
  PORT=""
  for _ in $(seq 1 300); do
    PORT=$(sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$SERVE_OUT")
    [ -n "$PORT" ] && return 0
    kill -0 "$PID" 2>/dev/null || { cat "$SERVE_LOG" >&2; echo "the server exited" >&2; exit 1; }
    sleep 0.1
  done
  cat "$SERVE_LOG" >&2
  echo "the server did not print its port" >&2
  exit 1
}
