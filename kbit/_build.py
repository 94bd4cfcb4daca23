"""Just-in-time build of the CUDA extension, cached on disk.

Importing kbit never compiles. The first CUDA call (or ``python -m kbit build``) compiles the
sources in ``kbit/csrc`` with ``torch.utils.cpp_extension.load`` (ninja builds the ``.cu`` files
in parallel) into ``$KBIT_CACHE_DIR`` (default ``~/.cache/kbit``), in a folder named after a
hash of the sources, the torch and CUDA versions and the target architectures, so a changed
source or a different GPU builds anew and an unchanged one loads in a second.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
# The .cu files are split so that ninja compiles them in parallel (one GEMM file per bit width).
SOURCES = ["binding.cpp", "quantize.cu", "repack.cu", "gemm.cu", "gemm_k2.cu", "gemm_k3.cu", "gemm_k4.cu", "gemm_k5.cu"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]


def cache_root() -> Path:
    return Path(os.environ.get("KBIT_CACHE_DIR") or Path.home() / ".cache" / "kbit").expanduser()


def target_archs() -> str:
    """TORCH_CUDA_ARCH_LIST if set, else the visible GPUs' compute capabilities, Hopper as '9.0a'.

    The GEMM's wgmma path is an sm_90a feature, so a plain '9.0' (from the GPUs or the environment) is
    built as '9.0a': the host picks that path on every compute capability 9.x device.
    """
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        archs = env.replace(",", ";").replace(" ", ";").split(";")
    else:
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        archs = [f"{major}.{minor}" for major, minor in caps]
    return ";".join(a + "a" if a == "9.0" else a for a in archs if a)


def build_dir() -> Path:
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cu", ".cuh", ".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{target_archs()}|{NVCC_FLAGS}".encode())
    return cache_root() / f"kbit_cuda_{h.hexdigest()[:16]}"


def _library_file(directory: Path) -> Path:
    return directory / "kbit_cuda.so"


@functools.lru_cache(maxsize=None)
def cuda_ext():
    """Build (first time only) and load the extension; returns ``torch.ops.kbit_cuda``."""
    if not torch.cuda.is_available():
        raise RuntimeError("kbit's CUDA extension needs a CUDA device; tensors on CPU use the reference path")
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    fresh = not _library_file(directory).exists()
    if fresh:
        print(f"kbit: building the CUDA extension for sm {target_archs()} in {directory} "
              "(first use only; a few minutes)...", file=sys.stderr, flush=True)
    os.environ["TORCH_CUDA_ARCH_LIST"] = target_archs()
    load(
        name="kbit_cuda",
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=NVCC_FLAGS,
        build_directory=str(directory),
        is_python_module=False,
        verbose=bool(os.environ.get("KBIT_VERBOSE_BUILD")),
    )
    if fresh:
        print("kbit: CUDA extension built.", file=sys.stderr, flush=True)
    return torch.ops.kbit_cuda


def build_info() -> dict:
    info = {"cache_root": str(cache_root()), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        d = build_dir()
        info.update(device=torch.cuda.get_device_name(), archs=target_archs(), build_dir=str(d),
                    built=_library_file(d).exists())
    return info
