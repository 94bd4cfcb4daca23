#!/usr/bin/env bash
# Compile the CPU kernels for arm64 (their NEON path) with a cross compiler: the x86-64 machines that build and
# test kbit never compile that path otherwise. Syntax and types only (-fsyntax-only: no arm64 torch to link).
# Skipped, with a line saying so, where no aarch64 cross compiler is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${KBIT_ARM64_CXX:-aarch64-linux-gnu-g++}
if ! command -v "$CXX" > /dev/null; then
  echo "compile_check_arm64: skipped ($CXX not found)"
  exit 0
fi
INCLUDES=$(python -c "import sysconfig, torch.utils.cpp_extension as c
print(' '.join('-I' + p for p in c.include_paths() + [sysconfig.get_paths()['include']]))")
# -march=armv8-a: NEON is part of every arm64 CPU; the kernel selects its NEON path by __ARM_NEON.
# shellcheck disable=SC2086
"$CXX" -std=c++20 -O2 -march=armv8-a -fsyntax-only -Werror=return-type $INCLUDES kbit/csrc/cpu/kbit_cpu.cpp
echo "compile_check_arm64: OK (kbit/csrc/cpu/kbit_cpu.cpp, NEON path, $CXX)"
