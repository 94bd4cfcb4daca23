#!/usr/bin/env bash
# A/B of the launch planner in one call: bench_gemm.py's sweep (M = 1..4096, K = 2..5, the seed shapes) and
# bench_moe.py, run in the tree that holds the old planner ($1, e.g. .stage/base) and in this tree, then
# compare_ab.py. Results under $2 (default $OUT or /tmp/planner_ab). Run from this tree's root.
set -euo pipefail
OLD=$(cd "$1" && pwd); NEW=$(pwd); RES=${2:-${OUT:-/tmp/planner_ab}}
M=1,4,8,16,17,32,64,128,192,256,384,512,768,1024,2048,4096
for side in old new; do
  tree=$([ $side = old ] && echo "$OLD" || echo "$NEW")
  mkdir -p "$RES/$side"
  (cd "$tree" && KBIT_CACHE_DIR=${KBIT_CACHE_DIR:-/tmp/kbit_cache}_$side python benchmarks/bench_gemm.py --m $M \
     --k 2,3,4,5 --calls 10 --replays 3 --peers "" --no-plot --no-check --out "$RES/$side" --tag ab >"$RES/$side/gemm.log" 2>&1)
  (cd "$tree" && KBIT_CACHE_DIR=${KBIT_CACHE_DIR:-/tmp/kbit_cache}_$side python benchmarks/bench_moe.py --quick \
     --replays 3 --out "$RES/$side" >"$RES/$side/moe.log" 2>&1)
done
for bench in gemm moe; do
  python benchmarks/compare_ab.py "$(ls "$RES"/old/${bench}_*.json | head -1)" "$(ls "$RES"/new/${bench}_*.json | head -1)"
done
