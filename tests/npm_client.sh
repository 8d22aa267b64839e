# Sourced by the tests of the official npm clients: npm_client TEST PACKAGE
# VERSION PREFIX installs PACKAGE@VERSION under PREFIX unless that version is
# there already, and exits 77 (ctest: skipped, SKIP_RETURN_CODE) when node,
# npm or the package cannot be had here.
npm_client() {
  local test=$1 package=$2 version=$3 prefix=$4
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "$test: needs node and npm (scripts/install-deps installs them): skipped" >&2
    exit 77
  fi
  if [ "$(node -p "try{require('$prefix/node_modules/$package/package.json').version}catch(e){''}")" != "$version" ]; then
    mkdir -p "$prefix"
    if ! npm install --prefix "$prefix" --no-audit --no-fund --silent "$package@$version" >&2; then
      echo "$test: needs the $package@$version npm package (npm install failed: offline?): skipped" >&2
      exit 77
    fi
  fi
}
