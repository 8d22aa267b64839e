#!/usr/bin/env bash
# Every command's --help and -h: help on stdout, nothing on stderr, exit 0, and
# every option line has a description. --version and -V print the version.
# The commands are read from the helps themselves (kvsparse --help, then the
# COMMAND --help of those with subcommands), so a new one is checked too.
set -uo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BIN="${KVS_BINARY:-$SRC/build/kvsparse}"
OUT=$(mktemp)
ERR=$(mktemp)
trap 'rm -f "$OUT" "$ERR"' EXIT
fail=0
bad() { echo "FAIL: $*" >&2; fail=1; }

# "  -m, --model DIR   text", "  --json   text" (indented a little: deeper lines
# continue a description): the option (and its value) and,
# after two spaces or more, a description that is not another option
option_line='^ {1,6}-'
described='^ {1,6}-[^ ]+( [^ ]+)*  +[^ -]'

check_help() { # $@: the command words before --help
  for flag in --help -h; do
    "$BIN" "$@" "$flag" >"$OUT" 2>"$ERR"
    local rc=$? what="kvsparse${*:+ $*} $flag"
    [ $rc -eq 0 ] || bad "$what: exit $rc, not 0"
    [ -s "$ERR" ] && bad "$what: wrote to stderr: $(head -c 300 "$ERR")"
    head -1 "$OUT" | grep -q '^usage: kvsparse' || bad "$what: stdout does not start with 'usage: kvsparse'"
    while IFS= read -r line; do
      bad "$what: an option without a description: '$line'"
    done < <(grep -E "$option_line" "$OUT" | grep -Ev "$described")
  done
}

# the command list of a help: "  NAME  text" lines whose NAME is a word
commands_of() { "$BIN" "$@" --help 2>/dev/null | sed -n 's/^  \([a-z][a-z]*\)  *[^ ].*/\1/p'; }

check_help
commands=$(commands_of)
for want in generate info tokenize serve eval bench convert; do
  grep -qx "$want" <<<"$commands" || bad "kvsparse --help does not list '$want'"
done
n=0
for cmd in $commands; do
  check_help "$cmd"
  n=$((n + 1))
  # a command with subcommands lists them in its help, each with its own --help
  if "$BIN" "$cmd" --help | head -1 | grep -q "^usage: kvsparse $cmd ([a-z]"; then
    for sub in $(commands_of "$cmd"); do
      check_help "$cmd" "$sub"
      n=$((n + 1))
    done
  fi
done
[ $n -ge 12 ] || bad "only $n commands found in the helps (generate, info, tokenize, serve, eval x2, bench x4 at least)"

for flag in --version -V; do
  v=$("$BIN" $flag 2>"$ERR")
  rc=$?
  [ $rc -eq 0 ] || bad "kvsparse $flag: exit $rc"
  [ -s "$ERR" ] && bad "kvsparse $flag: wrote to stderr"
  grep -Eq '^kvsparse [0-9]+\.[0-9]+\.[0-9]+ \(git ([0-9a-f]{4,}|unknown)\)$' <<<"$v" ||
    bad "kvsparse $flag printed '$v', not 'kvsparse X.Y.Z (git HASH)'"
done

# no command: the usage on stderr, exit 2 (a usage error)
"$BIN" >"$OUT" 2>"$ERR"
rc=$?
[ $rc -eq 2 ] || bad "kvsparse with no command: exit $rc, not 2"
grep -q '^usage: kvsparse' "$ERR" || bad "kvsparse with no command: no usage on stderr"

[ $fail -eq 0 ] && echo "test_cli_help: $n command helps and --version checked"
exit $fail
