#!/usr/bin/env bash
# Builds the libFuzzer targets (the `asan` preset: clang, ASan + UBSan, the tree CI tests under ASan) and
# runs each for SECONDS (default 30), as many at once as there are cores. Findings are written to
# build/asan/fuzz/findings/<target>/; the corpus grows in build/asan/fuzz/corpus/<target>/ between runs,
# starting from valid inputs each target writes to build/asan/fuzz/seeds/<target>/ (KVC_FUZZ_SEEDS).
#   scripts/fuzz.sh            # 30 s per target, as CI does
#   scripts/fuzz.sh 3600       # an hour per target
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
mapfile -t targets < <(cd tests/fuzz && ls fuzz_*.cpp | sed 's/\.cpp$//')
cmake --preset asan >/dev/null
cmake --build --preset asan --target "${targets[@]}"
work=build/asan/fuzz
# run NAME: one target for $seconds; its last lines into $work/NAME.log
run() {
  local name=$1
  mkdir -p "$work/corpus/$name" "$work/findings/$name" "$work/seeds/$name"
  KVC_FUZZ_SEEDS="$work/seeds/$name" "build/asan/tests/fuzz/$name" -max_total_time="$seconds" -max_len=4096 \
    -print_final_stats=1 -artifact_prefix="$work/findings/$name/" "$work/corpus/$name" "$work/seeds/$name" \
    >"$work/$name.out" 2>&1
  local status=$?
  { echo "== $name for ${seconds}s (exit $status) =="; tail -n 12 "$work/$name.out"; } >"$work/$name.log"
  return "$status"
}
export -f run
export seconds work
mkdir -p "$work"
status=0
printf '%s\n' "${targets[@]}" | xargs -P "$(nproc)" -I{} bash -c 'run {}' || status=$?
for name in "${targets[@]}"; do cat "$work/$name.log"; done
[ "$status" -eq 0 ] || { echo "fuzz: a target failed (its findings are in $work/findings/)" >&2; exit 1; }
