#!/usr/bin/env bash
# scripts/check-deps: passes on this tree; on a copy with a planted forbidden
# include (core including engine/engine.h; the server including an internal
# header of the model; a folder without a row in docs/DESIGN.md; a call cycle
# among the kv files) it fails and
# names the file, the line and the arrow.
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
CHECK="$SRC/scripts/check-deps"
"$CHECK" "$SRC"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails_with() { # fails_with WHAT EXPECTED: check-deps on $TMP exits 1 and prints EXPECTED
  local out rc=0
  out=$("$CHECK" "$TMP" 2>&1) || rc=$?
  if [ "$rc" -ne 1 ] || ! grep -qF -- "$2" <<<"$out"; then
    echo "test_check_deps: $1: expected exit 1 and '$2', got exit $rc:" >&2
    echo "$out" >&2
    exit 1
  fi
}
fresh() { rm -rf "$TMP"/*; mkdir -p "$TMP/docs"; cp -r "$SRC/src" "$TMP/"; cp "$SRC/docs/DESIGN.md" "$TMP/docs/"; }

fresh
"$CHECK" "$TMP"
printf '#include "engine/engine.h"\n' >>"$TMP/src/core/util.c"
line=$(wc -l <"$TMP/src/core/util.c")
fails_with "core -> engine" "src/core/util.c:$line: core -> engine: #include \"engine/engine.h\" (core may use: "

fresh
sed -i '0,/#include "/s//#include "model\/model_internal.h"\n#include "/' "$TMP/src/server/route.c"
fails_with "an internal header" "server -> model: #include \"model/model_internal.h\" (an internal header of model)"

fresh
printf '#include "backend/cuda/cuda_internal.h"\n' >"$TMP/src/kv/planted.c"
fails_with "a backend subfolder" "src/kv/planted.c:1: kv -> backend: #include \"backend/cuda/cuda_internal.h\" (an internal header of backend)"

fresh
mkdir -p "$TMP/src/newmod" && printf '#include "core/core.h"\n' >"$TMP/src/newmod/a.c"
fails_with "a folder without a row" "src/newmod: a module without a row"
fresh # block_pool.c calling up into kv_cache.c: a call cycle among the kv files
printf 'void kvs_kv_planted(kvs_kv_cache *kv) { kvs_kv_free(kv, 0); }\n' >>"$TMP/src/kv/block_pool.c"
printf 'void kvs_kv_planted_user(kvs_kv_cache *kv) { kvs_kv_planted(kv); }\n' >>"$TMP/src/kv/kv_cache.c"
fails_with "a call cycle in kv" "src/kv: "
echo "test_check_deps: ok"
