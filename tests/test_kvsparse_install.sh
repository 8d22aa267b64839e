#!/usr/bin/env bash
# libkvsparse as a user gets it: installed to a fresh prefix (the rules of
# `make install PREFIX=...`), examples/embed.c built through pkg-config against
# the installed copy (shared, then static), and run on the bundled model.
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BUILD="$(dirname "${KVS_BINARY:-$SRC/build/kvsparse}")"
CC="${CC:-cc}"
PREFIX=$(mktemp -d)
trap 'rm -rf "$PREFIX"' EXIT
# a sanitizer build's library needs its runtime in the program too
FLAGS=(-std=c11 -Wall -Wextra -Werror)
grep -q '^KVS_SANITIZE:BOOL=ON' "$BUILD/CMakeCache.txt" && FLAGS+=(-fsanitize=address,undefined)

cmake --install "$BUILD" --prefix "$PREFIX" >/dev/null
for f in lib/libkvsparse.so lib/libkvsparse.a include/kvsparse.h lib/pkgconfig/kvsparse.pc bin/kvsparse; do
  [ -e "$PREFIX/$f" ] || { echo "FAIL: make install left no $f" >&2; exit 1; }
done
export PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig"
[ "$(pkg-config --modversion kvsparse)" = "$(sed -n 's/^project(kvsparse VERSION \([0-9.]*\).*/\1/p' "$SRC/CMakeLists.txt")" ] \
  || { echo "FAIL: kvsparse.pc's version is not the project's" >&2; exit 1; }
# the header's include path alone: no dependency's private flags leak into a user's build
cflags=$(pkg-config --cflags kvsparse)
[ "$(echo $cflags)" = "-I$PREFIX/lib/pkgconfig/../../include" ] || { echo "FAIL: pkg-config --cflags kvsparse gives '$cflags'" >&2; exit 1; }

# shared: what `cc examples/embed.c $(pkg-config --cflags --libs kvsparse)` gives
"$CC" "${FLAGS[@]}" "$SRC/examples/embed.c" $(pkg-config --cflags --libs kvsparse) -o "$PREFIX/embed"
# static: libkvsparse.a and what it needs (pkg-config --static)
"$CC" "${FLAGS[@]}" "$SRC/examples/embed.c" $(pkg-config --cflags kvsparse) "$PREFIX/lib/libkvsparse.a" \
  $(pkg-config --static --libs kvsparse | sed 's/-lkvsparse\b//') -o "$PREFIX/embed-static"
if ldd "$PREFIX/embed-static" | grep -q libkvsparse; then echo "FAIL: embed-static loads libkvsparse.so" >&2; exit 1; fi

fail=0
for prog in embed embed-static; do
  out=$(LD_LIBRARY_PATH="$PREFIX/lib" OMP_NUM_THREADS=2 "$PREFIX/$prog" "$SRC/models/tiny-needle-llama" 2>"$PREFIX/err") \
    || { cat "$PREFIX/err" >&2; echo "FAIL: $prog exited non-zero" >&2; fail=1; continue; }
  if [[ "$out" == *48213* ]] && grep -q "generated" "$PREFIX/err"; then
    echo "PASS $prog: $out"
  else
    echo "FAIL $prog answered '$out'" >&2; cat "$PREFIX/err" >&2; fail=1
  fi
done
# a bad model folder: a message naming it, exit 1
if LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/embed" /nonexistent/model 2>"$PREFIX/err" >/dev/null; then
  echo "FAIL: embed on a missing folder exited 0" >&2; fail=1
elif ! grep -q "/nonexistent/model" "$PREFIX/err"; then
  echo "FAIL: the error does not name the folder: $(cat "$PREFIX/err")" >&2; fail=1
fi
exit $fail
