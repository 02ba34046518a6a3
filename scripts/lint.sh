#!/usr/bin/env bash
# Style and lint gate (run by CI): clang-format must leave every source unchanged, and clang-tidy's
# checks (.clang-tidy) must pass on the library, the CLI and the Python module. Needs a configured build for the compile
# database: BUILD_DIR (default build/ci).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build/ci}
mapfile -t sources < <(git ls-files '*.h' '*.cpp' | grep -E '^(include|src|tools|tests|bench|python)/')
clang-format --dry-run -Werror "${sources[@]}"
mapfile -t tidy < <(git ls-files 'src/*.cpp' 'tools/*.cpp' 'python/src/*.cpp')
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
printf '%s\n' "${tidy[@]}" | xargs -P "$(nproc)" -n 1 clang-tidy -p "$build_dir" --quiet --warnings-as-errors='*' \
  >"$log" 2>&1 || status=$?
grep -v -E '^[0-9]+ warnings( and [0-9]+ errors?)? generated|^Suppressed|^Use -header-filter' "$log" || true
[ "$status" -eq 0 ] || { echo "lint: clang-tidy failed" >&2; exit 1; }
echo "lint: clean"
