#!/usr/bin/env bash
# A/B of the GEMM launch planner: bench_gemm.py's sweep (the seed shapes, K = 2..5, M from 1 to 4096) and
# bench_moe.py --quick, run in a tree with the other planner (OLD, e.g. ../base) and in this one, then compare_ab.py:
# geomean new/old speed and the worst cell per benchmark. Run from this tree's root:
#
#   benchmarks/bench_planner_ab.sh OLD [STEP]     STEP: build | gemm | moe | compare | all (default)
#
# Steps keep their results in $AB_DIR (default /tmp/planner_ab), so on a machine that stays warm they can run as
# separate calls; `compare` also copies the JSON files to $OUT when set. Each tree builds its own extension
# (KBIT_CACHE_DIR_old / _new). AB_M and AB_K narrow the sweep (e.g. AB_K=2,3 then AB_K=4,5: the runs append).
set -euo pipefail
OLD=$(cd "$1" && pwd)
STEP=${2:-all}
NEW=$(pwd)
RES=${AB_DIR:-/tmp/planner_ab}
M=${AB_M:-1,4,16,32,64,128,256,512,1024,2048,4096}
K=${AB_K:-2,3,4,5}
CACHE=${KBIT_CACHE_DIR:-/tmp/kbit_cache}
start=$SECONDS
mkdir -p "$RES/old" "$RES/new"  # before any redirection into them

in_tree() {  # side, command...
  local side=$1 tree=$NEW
  shift
  [ "$side" = old ] && tree=$OLD
  (cd "$tree" && KBIT_CACHE_DIR=${CACHE}_$side "$@")
}

for side in old new; do
  case $STEP in
    build | all)
      in_tree $side python -c "import kbit, torch; x = torch.randn(1, 64, device='cuda', dtype=torch.float16); \
kbit.matmul(x, kbit.quantize(torch.randn(64, 64, device='cuda', dtype=torch.float16), 4))" >"$RES/$side/build.log" 2>&1
      echo "$side: built at $((SECONDS - start)) s" ;;&
    gemm | all)
      in_tree $side python benchmarks/bench_gemm.py --m "$M" --k "$K" --calls 10 --replays 3 --peers none --no-plot \
        --no-check --out "$RES/$side/k${K//,/}" --tag ab >"$RES/$side/gemm_k${K//,/}.log" 2>&1
      echo "$side: gemm K=$K at $((SECONDS - start)) s" ;;&
    moe | all)
      in_tree $side python benchmarks/bench_moe.py --quick --replays 3 --out "$RES/$side/moe" >"$RES/$side/moe.log" 2>&1
      echo "$side: moe at $((SECONDS - start)) s" ;;
  esac
done
if [ "$STEP" = compare ] || [ "$STEP" = all ]; then
  python benchmarks/compare_ab.py "$RES"/old/k*/gemm_*.json -- "$RES"/new/k*/gemm_*.json
  python benchmarks/compare_ab.py "$RES"/old/moe/moe_*.json -- "$RES"/new/moe/moe_*.json
  if [ -n "${OUT:-}" ]; then cp -r "$RES" "$OUT/planner_ab"; fi
fi
