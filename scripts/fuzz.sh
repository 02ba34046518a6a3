#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan) and runs each for SECONDS (default 30). Findings are
# written to build/fuzz/findings/<target>/; the corpus grows in build/fuzz/corpus/<target>/ between runs,
# starting from valid inputs each target writes to build/fuzz/seeds/<target>/ (KVC_FUZZ_SEEDS).
#   scripts/fuzz.sh            # 30 s per target, as CI does
#   scripts/fuzz.sh 3600       # an hour per target
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz
for bin in build/fuzz/tests/fuzz/fuzz_*; do
  name=$(basename "$bin")
  mkdir -p "build/fuzz/corpus/$name" "build/fuzz/findings/$name" "build/fuzz/seeds/$name"
  echo "== $name for ${seconds}s =="
  KVC_FUZZ_SEEDS="build/fuzz/seeds/$name" "$bin" -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 \
    -artifact_prefix="build/fuzz/findings/$name/" "build/fuzz/corpus/$name" "build/fuzz/seeds/$name" 2>&1 | tail -n 12
done
