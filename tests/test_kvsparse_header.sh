#!/usr/bin/env bash
# kvsparse.h, the public header, compiles alone as C11 and as C++17 (strict
# warnings), and a program of each language links against libkvsparse.so.
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BUILD="$(dirname "${KVS_BINARY:-$SRC/build/kvsparse}")"
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
SAN=()
grep -q '^KVS_SANITIZE:BOOL=ON' "$BUILD/CMakeCache.txt" && SAN=(-fsanitize=address,undefined)
cp "$SRC/src/kvsparse/kvsparse.h" "$DIR/"   # alone: no other header of the project beside it
cat >"$DIR/use.c" <<'C'
#include <kvsparse.h>
int main(void) {
    kvsparse_options o;
    kvsparse_options_init(&o);
    kvsparse_request r;
    kvsparse_request_init(&r);
    kvsparse_engine *e = 0;
    /* no model: the status and its message */
    return kvsparse_create("", &o, &e) == KVSPARSE_ERR_INVALID && kvsparse_last_error()[0] && !e ? 0 : 1;
}
C
cp "$DIR/use.c" "$DIR/use.cpp"
cc -std=c11 -Wall -Wextra -Wpedantic -Werror -I"$DIR" "${SAN[@]}" "$DIR/use.c" -L"$BUILD" -lkvsparse -o "$DIR/use_c"
c++ -std=c++17 -Wall -Wextra -Wpedantic -Werror -I"$DIR" "${SAN[@]}" "$DIR/use.cpp" -L"$BUILD" -lkvsparse -o "$DIR/use_cpp"
LD_LIBRARY_PATH="$BUILD" "$DIR/use_c"
LD_LIBRARY_PATH="$BUILD" "$DIR/use_cpp"
echo "PASS kvsparse.h alone: C11 and C++17"
