#!/usr/bin/env bash
# The planner A/B in one device call (an H200, at most 10 minutes), run from this tree's root:
#
#   benchmarks/bench_planner_ab.sh OLD                 OLD: the tree with the other planner (e.g. the repository root)
#   AB_DRY_RUN=1 benchmarks/bench_planner_ab.sh OLD    no GPU: the fit, compare and summary on committed files
#
# 1. build both trees' CUDA extensions at once, each into its own cache (/tmp/kbit_ab_old, /tmp/kbit_ab_new);
# 2. time the GEMM paths on this tree (`python -m kbit tune`, AB_TUNE_* restrict it, --seconds AB_TUNE_S) and fit
#    the planner's coefficients to those times (the tuned cache, which this tree's planner then plans from);
# 3. fit them again offline from the tune file as kbit/gpus/<GPU>.json is made, and check the two fits agree;
# 4. the A/B: benchmarks/planner_ab.py times kbit.matmul as a layer runs it over bench_gemm.py's sweep (AB_M x
#    AB_K x its nine shapes, the most telling first) on three sides one after the other, each given a third of the
#    time left: OLD; this tree on its shipped coefficients (kbit/gpus/, the tuned cache set aside); this tree on the
#    coefficients just fitted; after the MoE, up to AB_ROUNDS rounds in all while time is left (ab_<side>_r<n>.json),
#    each cell compared at its fastest time over the rounds;
# 5. bench_moe.py --quick in OLD and this tree (tuned), if AB_MOE_S seconds are left;
# 6. the summary, printed last: compare_ab.py of each new side against OLD on the layer GEMM and on the fused op
#    alone, the MoE, the fitted coefficients.
# Everything goes to $AB_DIR (default /tmp/planner_ab); with $OUT set, a tar of it and the summary, tune file and
# coefficient file beside it. Phases start only while AB_BUDGET_S (default 560) leaves them time.
set -euo pipefail
OLD=$(cd "$1" && pwd)
NEW=$(pwd)
RES=${AB_DIR:-/tmp/planner_ab}
DRY=${AB_DRY_RUN:-0}
BUDGET=${AB_BUDGET_S:-560}
TUNE_S=${AB_TUNE_S:-100}
# The shapes the fit needs most first (the A/B's losing cells: tile parts on 4096->4096, few tiles on 2048->1536,
# tile widths on 4096->14336, long k on 11008->4096), then the largest weight; the rest as time allows.
TUNE_SHAPES=${AB_TUNE_SHAPES:-4096->4096,2048->1536,4096->14336,11008->4096,8192->28672,2048->10240,14336->4096,\
28672->8192,4096->11008}
TUNE_TOKENS=${AB_TUNE_TOKENS:-1,16,32,64,128,256,512,1024,2048,4096}
BITS=${AB_K:-2,3,4,5}
M=${AB_M:-1,16,32,64,128,256,512,1024,2048,4096}  # bench_gemm.py's but 4 (decode: the same plan as at 1 and 16)
MOE_S=${AB_MOE_S:-120}
ROUNDS=${AB_ROUNDS:-3}  # rounds of the A/B at most (each cell compared at its fastest)
CACHE=${AB_CACHE:-/tmp/kbit_ab}
start=$SECONDS
rm -rf "$RES"
mkdir -p "$RES"

left() { echo $((BUDGET - (SECONDS - start))); }
say() { echo "[$((SECONDS - start)) s] $*" | tee -a "$RES/phases.log"; }
tree_of() { if [ "$1" = old ]; then echo "$OLD"; else echo "$NEW"; fi; }
in_tree() {  # side, command...: run in that tree with its own extension cache (the new sides share one)
  local side=$1 cache=${CACHE}_new
  shift
  [ "$side" = old ] && cache=${CACHE}_old
  (cd "$(tree_of "$side")" && KBIT_CACHE_DIR=$cache "$@")
}

# 1. build
if [ "$DRY" = 0 ]; then
  pids=()
  for side in old new; do
    in_tree $side env MAX_JOBS=8 python -m kbit build >"$RES/build_$side.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || { say "build failed"; tail -20 "$RES"/build_*.log; exit 1; }; done
  say "both trees built"
fi

# 2. tune this tree (if that fails, the A/B still runs: the new planner on its shipped coefficients)
tuned=
if [ "$DRY" = 0 ]; then
  rm -rf "${CACHE}_new/tuned"  # a tuned cache of an earlier run on this machine
  if in_tree new python -m kbit tune --bits "$BITS" --shapes "$TUNE_SHAPES" --tokens "$TUNE_TOKENS" \
    --seconds "$TUNE_S" >"$RES/tune.log" 2>&1; then
    tuned=$(ls "${CACHE}_new"/tuned/*.json)
  else
    say "tune failed: $(tail -1 "$RES/tune.log")"
  fi
else
  tuned=$NEW/benchmarks/results/tune_NVIDIA_H200.json
fi

# 3. fit the tune file offline, as the shipped kbit/gpus/<GPU>.json is made; the device's fit must equal it
fit() {
  tag=$(python - "$1" <<'EOF'
import json, sys
from kbit import tune_cache
print(tune_cache.file_tag(json.load(open(sys.argv[1]))["device"]))
EOF
  )
  cp "$1" "$RES/tune_$tag.json"
  python -m kbit tune --fit "$RES/tune_$tag.json" --configs tests/gemm_configs.json --out "$RES/$tag.json" \
    2>"$RES/fit_report.log"
  python - "$RES/tune_$tag.json" "$RES/$tag.json" <<'EOF' | tee -a "$RES/phases.log"
import json, math, sys
data = json.load(open(sys.argv[1]))
print(f"tuned: {len(data['shapes'])} shapes x bits, {sum(len(e['tokens']) for e in data['shapes'])} cells")
device_fit, offline = data.get("coefficients"), json.load(open(sys.argv[2]))
if device_fit is None:
    print("fit: the tune file holds no coefficients (not from kbit tune on a device): nothing to check")
else:
    far = [f"{p}.{f}" for p, cost in offline["paths"].items() for f, v in cost.items()
           if not math.isclose(v, device_fit["paths"][p][f], rel_tol=1e-6, abs_tol=1e-9)]
    same_tokens = device_fit["tokens"] == offline["tokens"]
    print("fit: the device's fit equals the offline fit" if not far and same_tokens
          else f"fit: the device's fit differs from the offline fit: {far or 'tokens'}")
EOF
  say "fitted: $RES/$tag.json"
}
tag=none
if [ -n "$tuned" ]; then fit "$tuned"; fi

# 4. the A/B over bench_gemm.py's sweep: old, new on its shipped coefficients, new on the ones just fitted; in rounds
# (round 1 before the MoE, more after it while time is left), each cell compared at its fastest of the rounds: one
# side's timing of an unchanged plan varies by more than 5% in about one cell of twenty between sides minutes apart.
ab() {  # side, seconds, file suffix: time it, given a share of the time left
  local out=ab_$1$3
  in_tree "$1" python "$NEW/benchmarks/planner_ab.py" --tree "$(tree_of "$1")" --out "$RES/$out.json" \
    --m "$M" --k "$BITS" --seconds "$2" >"$RES/$out.log" 2>&1 || { say "A/B $out failed"; tail -20 "$RES/$out.log"; }
  say "A/B $out done ($2 s allowed)"
}
round_s=0
ab_round() {  # round: every side once, one after the other (the tuned cache set aside for the shipped side)
  local t0=$SECONDS suffix=
  [ "$1" -gt 1 ] && suffix=_r$1
  local per_side=$((($(left) - 30) / $(echo $sides | wc -w)))
  [ "$per_side" -ge 30 ] || per_side=30
  for side in $sides; do
    if [ "$side" = shipped ] && [ -d "${CACHE}_new/tuned" ]; then mv "${CACHE}_new/tuned" "${CACHE}_new/tuned.aside"; fi
    if [ "$side" = tuned ] && [ -d "${CACHE}_new/tuned.aside" ]; then mv "${CACHE}_new/tuned.aside" "${CACHE}_new/tuned"; fi
    ab "$side" "$per_side" "$suffix"
  done
  round_s=$((SECONDS - t0))
}
sides="old shipped"
[ -n "$tuned" ] && sides="old shipped tuned"
if [ "$DRY" = 0 ]; then
  ab_round 1
else
  for side in $sides; do cp "$NEW/benchmarks/results/gemm_NVIDIA_H200.json" "$RES/ab_$side.json"; done
fi

# 5. MoE, if time is left
if [ "$DRY" = 0 ] && [ "$(left)" -ge "$MOE_S" ]; then
  for side in old new; do  # new: on the tuned cache where there is one
    in_tree $side python benchmarks/bench_moe.py --quick --replays 3 --out "$RES/moe_$side" \
      >"$RES/moe_$side.log" 2>&1 || say "MoE $side failed"
    say "MoE $side done"
  done
elif [ "$DRY" != 0 ]; then
  for side in old new; do mkdir -p "$RES/moe_$side" && cp "$NEW"/benchmarks/results/moe_*.json "$RES/moe_$side/"; done
else
  say "MoE A/B left out: $(left) s left, $MOE_S wanted"
fi

# 5b. more rounds of the A/B (4) while one more fits
round=2
while [ "$DRY" = 0 ] && [ "$round" -le "$ROUNDS" ] && [ "$(left)" -ge $((round_s + 30)) ]; do
  ab_round $round
  round=$((round + 1))
done
rounds_of() { ls "$RES/ab_$1.json" "$RES"/ab_"$1"_r*.json 2>/dev/null; }  # side: its A/B files, round 1 first

# 6. the summary (whatever fails in it, the rest is still printed)
set +e
{
  echo "== planner A/B, $((SECONDS - start)) s: old $OLD, new $NEW"
  grep -h "kbit tune: .*\(done at\|passed\)" "$RES/tune.log" 2>/dev/null | tail -3 || true
  cat "$RES/phases.log"
  for side in $sides; do
    [ "$side" = old ] && continue
    echo "-- $side against old, the layer GEMM (kbit.matmul on a GEMM-resident weight, dequantize + cuBLAS where" \
      "planned):"
    python benchmarks/compare_ab.py --worst 8 $(rounds_of old) -- $(rounds_of $side) || true
    echo "-- $side against old, the fused op alone (kbit.ops.gemm, bench_gemm.py's kbit row):"
    if grep -q '"fused_us"' "$RES/ab_$side.json"; then
      python benchmarks/compare_ab.py --field fused_us --worst 5 $(rounds_of old) -- $(rounds_of $side) || true
    else
      echo "  (no fused_us in these rows)"
    fi
  done
  if ls "$RES"/moe_old/moe_*.json "$RES"/moe_new/moe_*.json >/dev/null 2>&1; then
    echo "-- MoE (bench_moe.py --quick):"
    python benchmarks/compare_ab.py --worst 3 "$RES"/moe_old/moe_*.json -- "$RES"/moe_new/moe_*.json || true
  fi
  [ -f "$RES/$tag.json" ] || echo "-- no fitted coefficients (the tune failed: $RES/tune.log)"
  [ -f "$RES/$tag.json" ] && echo "-- fitted coefficients (kbit/gpus/$tag.json: python -m kbit tune --fit" \
    "benchmarks/results/tune_$tag.json --configs tests/gemm_configs.json --out kbit/gpus/$tag.json):" &&
  python - "$RES/$tag.json" "$RES/fit_report.log" <<'EOF'
import json, re, sys
fitted = json.load(open(sys.argv[1]))
for path, cost in fitted["paths"].items():
    print(f"  {path}: " + " ".join(f"{name}={value:.6g}" for name, value in cost.items()))
print("  tokens " + json.dumps(fitted["tokens"], separators=(",", ":")))
# kbit tune's report: one line per measured cell, "(planned PATH: R.RRx)" where the plan is not the fastest path
report = [line for line in open(sys.argv[2]) if " M = " in line]
slower = [float(m.group(1)) for line in report for m in [re.search(r": ([0-9.]+)x\)", line)] if m]
near = sum(r <= 1.03 for r in slower) + len(report) - len(slower)
print(f"  on its own data: the planned path within 3% of the fastest in {near} of {len(report)} cells, "
      f"worst {max(slower, default=1.0):.2f}x")
EOF
} >"$RES/summary.txt" 2>&1
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/planner_ab.tar.gz" -C "$(dirname "$RES")" "$(basename "$RES")"
  cp "$RES/summary.txt" "$RES/tune_$tag.json" "$RES/$tag.json" "$OUT/"  # the A/B files are in the tar: the device
  # returns at most 8 files
fi
cat "$RES/summary.txt"
