#!/usr/bin/env bash
# Compile the framework-free CUDA core for sm_80 and sm_90 with nvcc (no GPU needed) and fail on any
# compile error, on any register spill / stack frame in ptxas' report, or on wgmmas ptxas serialized. CI runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
# The sources and nvcc flags of kbit/_build.py's build (kbit/_build_spec.py; read without importing kbit or torch).
spec() { python -c "import runpy; s = runpy.run_path('kbit/_build_spec.py'); print(' '.join($1))"; }
read -r -a SOURCES <<<"$(spec "'kbit/csrc/' + f for f in s['CUDA_SOURCES']")"
read -r -a NVCC_FLAGS <<<"$(spec "s['NVCC_FLAGS']")"
read -r -a CXX_FLAGS <<<"$(spec "s['CXX_FLAGS']")"
ARCHS=(80 90a)  # 90a: the GEMM's wgmma path (kbit/_build.py builds Hopper as 9.0a)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
jobs_max=${COMPILE_JOBS:-$(nproc)}
# A failed compile leaves a mark in $out: `wait PID` on jobs that ended long before can answer "not a child of this
# shell" and fail a clean run.
for arch in "${ARCHS[@]}"; do
  for src in "${SOURCES[@]}"; do
    log="$out/$(basename "$src" .cu)_sm$arch.log"
    ( "$NVCC" "${NVCC_FLAGS[@]}" -gencode "arch=compute_$arch,code=sm_$arch" \
        -Xptxas -v -c "$src" -o "${log%.log}.o" >"$log" 2>&1 ||
        { echo "COMPILE ERROR: $src sm_$arch"; cat "$log"; touch "$out/failed"; } ) &
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do sleep 0.2; done
  done
done
wait
[ ! -e "$out/failed" ] || { echo "compile_check: FAILED (compile error)"; exit 1; }
kernels=$(cat "$out"/*.log | grep -c "Used [0-9]* registers" || true)
spills=$(cat "$out"/*.log | grep -E "[1-9][0-9]* bytes (spill stores|spill loads|stack frame)" || true)
if [ -n "$spills" ]; then
  echo "compile_check: FAILED: register spills or stack frames:"; echo "$spills"
  grep -B2 -E "[1-9][0-9]* bytes (spill|stack)" "$out"/*.log | grep -E "Compiling entry" || true
  exit 1
fi
# ptxas serializing wgmmas (C7512: too few registers; C7518: groups in flight across a loop) leaves a kernel correct
# but slow.
serialized=$(cat "$out"/*.log | grep -E "wgmma.mma_async instructions are serialized" || true)
if [ -n "$serialized" ]; then
  echo "compile_check: FAILED: wgmma serialized:"; echo "$serialized" | sort -u; exit 1
fi
# The PyTorch binding: a syntax and type check against torch's headers (CPU wheels ship them without the CMake-made
# c10/cuda macro header, which only names build options, so an empty one stands in).
if TORCH_INC=$(python -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))" 2>/dev/null); then
  CUDA_INC=$(dirname "$(command -v "$NVCC")")/../include
  [ -f "$CUDA_INC/cuda_runtime.h" ] || CUDA_INC=$(ls -d /usr/local/cuda*/include 2>/dev/null | head -1)
  mkdir -p "$out/inc/c10/cuda/impl" && echo "#pragma once" >"$out/inc/c10/cuda/impl/cuda_cmake_macros.h"
  # shellcheck disable=SC2086
  ${CXX:-g++} "${CXX_FLAGS[@]}" -fsyntax-only $TORCH_INC -I"$out/inc" -I"$CUDA_INC" kbit/csrc/binding.cpp ||
    { echo "compile_check: FAILED (kbit/csrc/binding.cpp)"; exit 1; }
  binding="binding.cpp checked, "
fi
maxreg=$(cat "$out"/*.log | grep -oE "Used [0-9]+ registers" | awk '{print $2}' | sort -n | tail -1)
echo "compile_check: OK: ${binding:-}${#SOURCES[@]} sources x sm_{${ARCHS[*]}}, $kernels kernels, 0 spills, max $maxreg registers"
