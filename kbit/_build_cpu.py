"""Just-in-time build of the CPU kernels (``kbit/csrc/cpu``), cached and locked like the CUDA extension (``kbit._build``).

The first CPU quantize, dequantize or matmul compiles ``kbit_cpu.cpp`` with the host's C++ compiler, with the
instruction-set flags this CPU supports (AVX-512 with GFNI and VBMI, else AVX-512, else AVX2 + FMA on x86-64; NEON
is part of arm64), into a folder of ``$KBIT_CACHE_DIR`` named after a hash of the source (its text and path), the
torch version and those flags. ``KBIT_CPU_ISA`` picks a smaller set (``avx512``, ``avx2``, ``scalar``) to compare or
test them; ``KBIT_CPU_KERNELS=0`` keeps the reference path.

Without a compiler (or ninja), or when the build fails, the ops keep their pure-PyTorch reference path and one
warning says how to get the fast one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from ._build import build_lock, cache_root, lock_timeout

SOURCE = Path(__file__).parent / "csrc" / "cpu" / "kbit_cpu.cpp"
ISA_ENV, ENABLE_ENV = "KBIT_CPU_ISA", "KBIT_CPU_KERNELS"
# Instruction sets, best first, with the CPU flags (/proc/cpuinfo) each needs and the compiler flags that enable it.
X86_ISAS = {"avx512_gfni": ({"avx512f", "avx512bw", "avx512vl", "avx512vbmi", "gfni", "avx2", "fma"},
                            ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vbmi", "-mgfni", "-mavx2", "-mfma"]),
            "avx512": ({"avx512f", "avx2", "fma"}, ["-mavx512f", "-mavx2", "-mfma"]),
            "avx2": ({"avx2", "fma"}, ["-mavx2", "-mfma"]),
            "scalar": (set(), [])}


class CpuKernelWarning(UserWarning):
    """The fast CPU kernels are not available; kbit runs its reference path on CPU tensors."""


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa() -> str:
    """The instruction set the kernels are built for: the best this CPU has, or ``$KBIT_CPU_ISA`` if it has that."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "neon"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "scalar"
    flags, wanted = _cpu_flags(), os.environ.get(ISA_ENV, "")
    if wanted and wanted not in X86_ISAS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(X86_ISAS)}, got {wanted!r}")
    usable = [name for name, (needs, _) in X86_ISAS.items() if needs <= flags]
    if wanted and wanted not in usable:
        raise ValueError(f"{ISA_ENV}={wanted}, but this CPU lacks {sorted(X86_ISAS[wanted][0] - flags)}")
    return wanted or usable[0]


def compile_flags() -> list:
    isa_flags = X86_ISAS[isa()][1] if isa() in X86_ISAS else []
    # at::parallel_for is inline code that runs on torch's OpenMP pool only when compiled with OpenMP.
    return ["-O3", *isa_flags, *(["-fopenmp"] if torch.backends.openmp.is_available() else [])]


def build_dir() -> Path:
    h = hashlib.sha256(SOURCE.read_bytes())
    # The source's path too: ninja rebuilds when the compile command (which names it) changes, so two copies of
    # kbit (a checkout and an installed wheel) sharing one folder would rebuild each other's library in turn.
    h.update(f"{SOURCE}|{torch.__version__}|{compile_flags()}".encode())
    return cache_root() / f"kbit_cpu_{isa()}_{h.hexdigest()[:16]}"


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX", "c++"))


def _fallback(reason: str) -> None:
    warnings.warn(f"kbit: {reason}; CPU quantize, dequantize and matmul use the slow reference path. For the fast CPU "
                  "kernels install a C++ compiler (g++ or clang, or set CXX) and ninja (pip install ninja)",
                  CpuKernelWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def cpu_ext():
    """Build (first time only) and load the CPU kernels: ``torch.ops.kbit_cpu``, or None (with one warning) where
    they cannot be built. The result is kept for the process."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    from torch.utils.cpp_extension import is_ninja_available, load

    if _compiler() is None:
        _fallback(f"no C++ compiler found ({os.environ.get('CXX', 'c++')})")
        return None
    if not is_ninja_available():
        _fallback("ninja, which torch needs to build extensions, is not installed")
        return None
    directory = build_dir()
    fresh = not (directory / "kbit_cpu.so").exists()
    if fresh:
        print(f"kbit: building the CPU kernels ({isa()}) in {directory} (first use only; about a minute)...",
              file=sys.stderr, flush=True)
    flags = compile_flags()
    try:
        with build_lock(directory, lock_timeout()):
            load(name="kbit_cpu", sources=[str(SOURCE)], extra_cflags=flags,
                 extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [], build_directory=str(directory),
                 is_python_module=False, verbose=bool(os.environ.get("KBIT_VERBOSE_BUILD")))
    except Exception as e:  # a broken toolchain must not break CPU inference: the reference path still works
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        _fallback(f"building the CPU kernels in {directory} failed ({first_line})")
        return None
    return torch.ops.kbit_cpu
