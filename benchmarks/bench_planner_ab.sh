#!/usr/bin/env bash
# A/B of the GEMM launch planner in one call: bench_gemm.py's sweep (the seed shapes, K = 2..5, M from 1 to 4096) and
# bench_moe.py --quick, run in a tree with the other planner ($1, e.g. ../base) and in this one, then compare_ab.py:
# geomean new/old speed and the worst cell per benchmark. Results under $2 (default $OUT/planner_ab). Run from this
# tree's root; each tree builds its own extension (KBIT_CACHE_DIR_old / _new).
set -euo pipefail
OLD=$(cd "$1" && pwd)
NEW=$(pwd)
RES=${2:-${OUT:-/tmp}/planner_ab}
M=${AB_M:-1,4,16,32,64,128,256,512,1024,2048,4096}
CACHE=${KBIT_CACHE_DIR:-/tmp/kbit_cache}
start=$SECONDS
for side in old new; do
  tree=$NEW
  [ "$side" = old ] && tree=$OLD
  mkdir -p "$RES/$side"
  (cd "$tree" && KBIT_CACHE_DIR=${CACHE}_$side python -c "import kbit, torch; kbit.matmul(torch.randn(1, 64, \
      device='cuda', dtype=torch.float16), kbit.quantize(torch.randn(64, 64, device='cuda', dtype=torch.float16), 4))" \
      >"$RES/$side/build.log" 2>&1)
  echo "$side: built at $((SECONDS - start)) s"
  (cd "$tree" && KBIT_CACHE_DIR=${CACHE}_$side python benchmarks/bench_gemm.py --m "$M" --k 2,3,4,5 --calls 10 \
      --replays 3 --peers none --no-plot --no-check --out "$RES/$side" --tag ab >"$RES/$side/gemm.log" 2>&1)
  (cd "$tree" && KBIT_CACHE_DIR=${CACHE}_$side python benchmarks/bench_moe.py --quick --replays 3 \
      --out "$RES/$side" >"$RES/$side/moe.log" 2>&1)
  echo "$side: benchmarked at $((SECONDS - start)) s"
done
for bench in gemm moe; do
  python benchmarks/compare_ab.py "$(ls "$RES"/old/${bench}_*.json | head -1)" "$(ls "$RES"/new/${bench}_*.json | head -1)"
done
