#!/usr/bin/env bash
# One-command GPU check of kbit: build the CUDA extension, run every test (CPU + GPU), run the
# compute-sanitizer subset (memcheck, racecheck), run the benchmarks, print a PASS/FAIL summary
# and the key benchmark numbers last. Exits non-zero if any step failed.
#
#   scripts/gpu_check.sh                 # build, tests, sanitizers, bench_quant, bench_gemm --quick
#   scripts/gpu_check.sh --full          # ... with the full bench_gemm sweep (~8 min)
#   scripts/gpu_check.sh --skip-bench    # build, tests, sanitizers only
#   scripts/gpu_check.sh --only-bench    # build, then the benchmarks only
#
# Logs go to $OUT (when set, e.g. on the device runner) or ./gpu_check_logs; benchmark results to
# $OUT/results or gpu_check_logs/results (commit a result set to benchmarks/results deliberately). Env: KBIT_CACHE_DIR (default $REPO/.kbit_cache), PYTHON
# (default python), PYTEST_ARGS (extra pytest arguments), KBIT_SANITIZE_KERNELS (a
# compute-sanitizer --kernel-name filter, e.g. "kns=kbit"), KBIT_TEST_SEED (replay a test run).

set -u -o pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

FULL=0; SKIP_BENCH=0; ONLY_BENCH=0
for arg in "$@"; do
  case "$arg" in
    --full) FULL=1 ;;
    --skip-bench) SKIP_BENCH=1 ;;
    --only-bench) ONLY_BENCH=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg'" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ $SKIP_BENCH == 1 && $ONLY_BENCH == 1 ]]; then
  echo "gpu_check.sh: --skip-bench and --only-bench are exclusive" >&2; exit 2
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
export PYTHONUNBUFFERED=1
export KBIT_CACHE_DIR="${KBIT_CACHE_DIR:-$REPO/.kbit_cache}"
PY="${PYTHON:-python}"
if [[ -n "${OUT:-}" ]]; then LOG_DIR="$OUT"; RESULTS_DIR="$OUT/results"; else
  LOG_DIR="$REPO/gpu_check_logs"; RESULTS_DIR="$LOG_DIR/results"; fi
mkdir -p "$LOG_DIR" "$RESULTS_DIR"
export KBIT_BENCH_OUT="$RESULTS_DIR"

declare -a NAMES=() STATUS=() NOTES=()
FAILED=0
record() {  # name status note
  NAMES+=("$1"); STATUS+=("$2"); NOTES+=("$3")
  [[ "$2" == FAIL ]] && FAILED=1
  echo "==> $1: $2${3:+ ($3)}"
}
banner() { echo; echo "==================== $* ===================="; }
now() { date +%s; }

# ---------------------------------------------------------------------------- environment
banner "environment"
{
  echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'))"
  echo "KBIT_CACHE_DIR=$KBIT_CACHE_DIR  logs: $LOG_DIR  results: $RESULTS_DIR"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  command -v nvcc >/dev/null && nvcc --version | tail -n 2 | head -n 1 || echo "nvcc: not on PATH"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
} 2>&1 | tee "$LOG_DIR/env.log"

# ---------------------------------------------------------------------------- build
banner "build"
BUILD_OK=0
t0=$(now)
if [[ -f "$REPO/kbit/__main__.py" ]]; then
  KBIT_VERBOSE_BUILD=1 "$PY" -m kbit build 2>&1 | tee "$LOG_DIR/build.log"
  rc=$?
  if [[ $rc != 0 ]]; then
    echo "'python -m kbit build' failed (rc=$rc); falling back to kbit._build.cuda_ext()"
    KBIT_VERBOSE_BUILD=1 "$PY" -c "import kbit._build as b; b.cuda_ext()" 2>&1 | tee -a "$LOG_DIR/build.log"
    rc=$?
    CLI_NOTE="python -m kbit build failed, fallback"
  else
    CLI_NOTE="python -m kbit build"
  fi
else
  KBIT_VERBOSE_BUILD=1 "$PY" -c "import kbit._build as b; b.cuda_ext()" 2>&1 | tee "$LOG_DIR/build.log"
  rc=$?
  CLI_NOTE="kbit._build.cuda_ext(); no kbit/__main__.py"
fi
BUILD_S=$(( $(now) - t0 ))
if [[ $rc == 0 ]]; then
  BUILD_OK=1
  record build PASS "${BUILD_S}s, $CLI_NOTE"
else
  record build FAIL "rc=$rc after ${BUILD_S}s, see $LOG_DIR/build.log"
fi
# ptxas spill report (present when the build ran with -Xptxas -v); informational
SPILLS=$(grep -E "bytes spill (stores|loads)" "$LOG_DIR/build.log" 2>/dev/null | grep -Ev "\b0 bytes spill stores, 0 bytes spill loads" | wc -l)
if grep -q "bytes spill" "$LOG_DIR/build.log" 2>/dev/null; then
  if [[ "$SPILLS" -gt 0 ]]; then
    record "ptxas spills" WARN "$SPILLS kernel(s) with non-zero spills, see build.log"
  else
    record "ptxas spills" PASS "no spills"
  fi
fi

skip_rest() { record "$1" SKIP "build failed"; }

# ---------------------------------------------------------------------------- tests
if [[ $ONLY_BENCH == 0 ]]; then
  banner "pytest (all tests, CPU + GPU)"
  if [[ $BUILD_OK == 1 ]]; then
    t0=$(now)
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -ra -p no:cacheprovider --junitxml="$LOG_DIR/pytest.xml" tests ${PYTEST_ARGS:-} 2>&1 \
      | tee "$LOG_DIR/pytest.log"
    rc=$?
    line=$(grep -E " in [0-9.]+s" "$LOG_DIR/pytest.log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
    if [[ $rc == 0 ]]; then record pytest PASS "$line, $(( $(now) - t0 ))s"; else
      record pytest FAIL "rc=$rc: $line, see $LOG_DIR/pytest.log"; fi
  else
    skip_rest pytest
  fi

  # ------------------------------------------------------------------------ compute-sanitizer
  SAN="$(command -v compute-sanitizer || true)"
  if [[ -z "$SAN" ]]; then
    for c in "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
      [[ -x "$c" ]] && SAN="$c" && break
    done
  fi
  for tool in memcheck racecheck; do
    banner "compute-sanitizer --tool $tool (pytest -k sanitize)"
    if [[ $BUILD_OK != 1 ]]; then skip_rest "sanitizer $tool"; continue; fi
    if [[ -z "$SAN" ]]; then record "sanitizer $tool" FAIL "compute-sanitizer not found"; continue; fi
    # racecheck prints every hazard, so that scripts/racecheck_verdict.py can judge them all.
    opts=(--tool "$tool" --error-exitcode 86 --print-limit "$([[ $tool == racecheck ]] && echo 100000 || echo 50)")
    help="$("$SAN" --help 2>/dev/null)"
    grep -q -- "--report-api-errors" <<<"$help" && opts+=(--report-api-errors no)
    [[ $tool == memcheck ]] && grep -q -- "--padding" <<<"$help" && opts+=(--padding 256)
    [[ -n "${KBIT_SANITIZE_KERNELS:-}" ]] && opts+=(--kernel-name "$KBIT_SANITIZE_KERNELS")
    log="$LOG_DIR/sanitizer_$tool.log"
    t0=$(now)
    # No caching allocator: every tensor is its own cudaMalloc, so out-of-bounds accesses are visible.
    # Racecheck stops tracking at its default hazard limit, which the bulk copies' class alone reaches.
    NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS=1000000 PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      "$SAN" "${opts[@]}" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_sanitize.py -k sanitize 2>&1 | tee "$log"
    rc=$?
    summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -n 2 | sed 's/=//g; s/^ *//' | tr '\n' ';')
    tests_line=$(grep -E " in [0-9.]+s" "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
    clean=0
    if [[ $tool == memcheck ]] && grep -q "ERROR SUMMARY: 0 errors" "$log"; then clean=1; fi
    if [[ $tool == racecheck ]]; then  # clean, or only the bulk copies' hazards racecheck cannot order
      verdict=$("$PY" scripts/racecheck_verdict.py "$log") && clean=1 && [[ $rc == 86 ]] && rc=0
      summary="$summary $(head -n 1 <<<"$verdict")"
    fi
    if [[ $rc == 0 && $clean == 1 ]] && grep -qE "[0-9]+ passed" "$log"; then
      record "sanitizer $tool" PASS "$summary $tests_line, $(( $(now) - t0 ))s"
    else
      record "sanitizer $tool" FAIL "rc=$rc $summary $tests_line, see $log"
    fi
  done
fi

# ---------------------------------------------------------------------------- benchmarks
if [[ $SKIP_BENCH == 0 ]]; then
  banner "bench_quant.py"
  if [[ $BUILD_OK == 1 ]]; then
    t0=$(now)
    "$PY" benchmarks/bench_quant.py --out "$RESULTS_DIR" 2>&1 | tee "$LOG_DIR/bench_quant.log"
    rc=$?
    if [[ $rc == 0 ]]; then record bench_quant PASS "$(( $(now) - t0 ))s"; else
      record bench_quant FAIL "rc=$rc, see $LOG_DIR/bench_quant.log"; fi
  else
    skip_rest bench_quant
  fi
  if [[ $FULL == 1 ]]; then GEMM_ARGS=(); GEMM_NAME="bench_gemm (full)"; else GEMM_ARGS=(--quick); GEMM_NAME="bench_gemm --quick"; fi
  banner "$GEMM_NAME"
  if [[ $BUILD_OK == 1 ]]; then
    t0=$(now)
    "$PY" benchmarks/bench_gemm.py "${GEMM_ARGS[@]}" --out "$RESULTS_DIR" 2>&1 | tee "$LOG_DIR/bench_gemm.log"
    rc=$?
    if [[ $rc == 0 ]]; then record "$GEMM_NAME" PASS "$(( $(now) - t0 ))s"; else
      record "$GEMM_NAME" FAIL "rc=$rc (kbit timing failed or accuracy check), see $LOG_DIR/bench_gemm.log"; fi
  else
    skip_rest "$GEMM_NAME"
  fi
fi

# ---------------------------------------------------------------------------- summary
banner "summary"
for i in "${!NAMES[@]}"; do
  printf '%-22s %-5s %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${NOTES[$i]}"
done | tee "$LOG_DIR/summary.txt"
if [[ $SKIP_BENCH == 0 ]]; then
  shopt -s nullglob
  sums=("$RESULTS_DIR"/quant_*_summary.txt "$RESULTS_DIR"/gemm_*_summary.txt)
  if [[ $FULL == 0 ]]; then sums=("$RESULTS_DIR"/quant_*_summary.txt "$RESULTS_DIR"/gemm_*_quick_summary.txt); fi
  if (( ${#sums[@]} )); then
    banner "key benchmark numbers"
    for f in "${sums[@]}"; do
      # only files written by this run
      [[ "$f" -nt "$LOG_DIR/env.log" ]] && { cat "$f"; echo; }
    done | tee -a "$LOG_DIR/summary.txt"
  fi
fi
if [[ $FAILED == 0 ]]; then echo "gpu_check: ALL PASSED"; else echo "gpu_check: FAILED"; fi
exit $FAILED
