#!/usr/bin/env bash
# Runs llama.cpp's side (llama_seq_ops, see llama_seq_ops.cpp) and bench_kv_cache alternately, ROUNDS times,
# for docs/performance.md's sequence-operation and decode-step tables. Each round waits (10 minutes at most)
# until the 2 cores have been >= IDLE% idle for 3 s, and prints how idle they were during each run (about
# 50% when only the run itself is busy). Outputs in OUT/llama_N.txt and OUT/kvc_N.txt.
#   LLAMA=/tmp/llama_seq_ops BENCH=build/release/bench/bench_kv_cache bench/peer/alternate.sh
set -u
llama=${LLAMA:-/tmp/llama_seq_ops}
bench=${BENCH:-build/release/bench/bench_kv_cache}
out=${OUT:-/tmp/kvc-alternate}
mkdir -p "$out"
snap() { read -r _ u n s i w x y z _ </proc/stat; echo "$((u + n + s + i + w + x + y + z)) $((i + w))"; }
idle_between() { echo $((100 * ($4 - $2) / ($3 - $1))); }
for r in $(seq "${ROUNDS:-5}"); do
  for _ in $(seq 200); do
    a=$(snap); sleep 3; b=$(snap)
    f=$(idle_between $a $b)
    [ "$f" -ge "${IDLE:-90}" ] && break
  done
  echo "round $r: idle before ${f}%"
  a=$(snap); "$llama" --rounds 50 >"$out/llama_$r.txt"; b=$(snap); il=$(idle_between $a $b)
  a=$(snap)
  "$bench" --benchmark_filter='seq_|floor|decode' --benchmark_repetitions=5 \
    --benchmark_report_aggregates_only=true --benchmark_color=false >"$out/kvc_$r.txt" 2>&1
  b=$(snap); ik=$(idle_between $a $b)
  echo "  idle during llama.cpp ${il}%, during kvcache ${ik}%"
  grep median "$out/llama_$r.txt" | sed 's/^/  llama.cpp /'
  grep -E '^   bm_|floor of|ns @' "$out/kvc_$r.txt"
done
