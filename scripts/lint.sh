#!/usr/bin/env bash
# Style and lint gate (run by CI): clang-format must leave every source unchanged, and clang-tidy's
# checks (.clang-tidy) must pass on the library, the CLI and the Python module. Needs a configured build for the compile
# database: BUILD_DIR (default build/ci).
#
# clang-tidy spends most of its time matching the headers a file includes (the standard library, CLI11,
# pybind11), not the file itself, so it runs once per build target on a file that includes every source of
# that target (tidy_groups.py): the same checks over the same code, each header matched once per target
# instead of once per file. A target whose sources do not compile as one file (two files define the same
# name in an anonymous namespace) is checked file by file instead.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build/ci}
mapfile -t sources < <(git ls-files '*.h' '*.cpp' | grep -E '^(include|src|tools|tests|bench|python)/')
clang-format --dry-run -Werror "${sources[@]}"

tidy_dir="$build_dir/tidy"
git ls-files 'src/*.cpp' 'tools/*.cpp' 'python/src/*.cpp' |
  python3 scripts/tidy_groups.py "$build_dir/compile_commands.json" "$tidy_dir"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
tidy() {  # tidy FILE...: clang-tidy on each, nproc at a time, into $log; fails if any fails
  printf '%s\n' "$@" | xargs -P "$(nproc)" -n 1 clang-tidy -p "$tidy_dir" --quiet --warnings-as-errors='*' \
    >"$log" 2>&1
}
status=0
mapfile -t groups < <(cut -f1 "$tidy_dir/groups.tsv")
echo "lint: clang-tidy on $(grep -c '/group_' "$tidy_dir/groups.tsv" || true) targets and $(grep -vc '/group_' "$tidy_dir/groups.tsv" || true) sources on their own (not in the compile database)"
tidy "${groups[@]}" || status=$?
if grep -q 'clang-diagnostic-error' "$log"; then
  # some target's sources do not compile as one file: every source on its own (slow, but as strict)
  grep -B2 -A2 'clang-diagnostic-error' "$log" | head -n 20 >&2
  echo "lint: a target's sources do not compile as one file (above); checking every source on its own" >&2
  mapfile -t singles < <(cut -f2- "$tidy_dir/groups.tsv" | tr '\t' '\n')
  status=0
  tidy "${singles[@]}" || status=$?
fi
grep -v -E '^[0-9]+ warnings( and [0-9]+ errors?)? generated|^Suppressed|^Use -header-filter|^Error while processing' \
  "$log" || true
[ "$status" -eq 0 ] || { echo "lint: clang-tidy failed" >&2; exit 1; }
echo "lint: clean"
