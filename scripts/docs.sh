#!/usr/bin/env bash
# API documentation (run by CI): Doxygen over include/kvcache/*.h and include/kvcache/runtime/*.h with
# docs/Doxyfile, HTML into KVC_DOCS_DIR (default build/docs; the pages are in KVC_DOCS_DIR/html). Fails on
# any Doxygen warning, an undocumented public declaration included.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v doxygen >/dev/null || { echo "docs: doxygen not found (scripts/install-deps.sh --ci)" >&2; exit 1; }
out=${KVC_DOCS_DIR:-build/docs}
mkdir -p "$out"
KVC_DOCS_DIR=$(cd "$out" && pwd)
KVC_VERSION=$(sed -n 's/^project(kvcache VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
export KVC_DOCS_DIR KVC_VERSION
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
doxygen docs/Doxyfile >"$log" 2>&1 || status=$?
if [ "$status" -ne 0 ] || [ -s "$log" ]; then
  cat "$log" >&2
  echo "docs: doxygen reported $(grep -cE 'warning:|error:' "$log" || true) warning(s)" >&2
  exit 1
fi
echo "docs: clean ($KVC_DOCS_DIR/html/index.html)"
