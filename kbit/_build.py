"""Just-in-time build of the CUDA extension, cached on disk.

Importing kbit never compiles. The first CUDA call (or ``python -m kbit build``) compiles the
sources in ``kbit/csrc`` with ``torch.utils.cpp_extension.load`` (ninja builds the ``.cu`` files
in parallel) into ``$KBIT_CACHE_DIR`` (default ``~/.cache/kbit``), in a folder named after a
hash of the sources, the torch and CUDA versions and the target architectures, so a changed
source or a different GPU builds anew and an unchanged one loads in a second.

Concurrent processes: a build holds an exclusive ``flock`` on ``build.lock`` in that folder (the
file names the holder's pid). The kernel releases an flock when its holder dies, so a build killed
mid-compile (nvcc out of memory, say) never blocks later ones; a waiting process says whom it waits
for and gives up after ``$KBIT_BUILD_LOCK_TIMEOUT`` seconds (default 1800). While holding it, a
``lock`` file left by ``torch.utils.cpp_extension`` (which otherwise waits on it forever) can only
be stale, and is removed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from ._build_spec import BINDING, CUDA_SOURCES, CXX_FLAGS, NVCC_FLAGS

CSRC = Path(__file__).parent / "csrc"
SOURCES = [BINDING, *CUDA_SOURCES]


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


LOCK_NAME = "build.lock"
TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
DEFAULT_LOCK_TIMEOUT_S = 1800.0


def lock_timeout() -> float:
    """``$KBIT_BUILD_LOCK_TIMEOUT``: finite and above 0 (a NaN deadline never passes, 0 or less never waits)."""
    raw = os.environ.get("KBIT_BUILD_LOCK_TIMEOUT", "")
    if not raw:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"KBIT_BUILD_LOCK_TIMEOUT must be a finite number of seconds above 0, got {raw!r}")
    return value


@contextlib.contextmanager
def build_lock(directory: Path, timeout: float, poll_s: float = 0.2) -> Iterator[None]:
    """Hold the folder's build lock (see the module docstring); TimeoutError after ``timeout`` seconds."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_NAME, "a+") as f:
        deadline, told = time.monotonic() + timeout, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"kbit: gave up after {timeout:.15g} s waiting for process {holder} to finish building the "
                        f"CUDA extension in {directory} (set KBIT_BUILD_LOCK_TIMEOUT to wait longer)") from None
                if not told:
                    print(f"kbit: waiting for process {holder}, which is building the CUDA extension in {directory}",
                          file=sys.stderr, flush=True)
                    told = True
                time.sleep(poll_s)
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            stale = directory / TORCH_LOCK_NAME
            if stale.exists():
                print(f"kbit: removing {stale}, left by a build that did not finish", file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def arch_list(archs: str) -> Iterator[None]:
    """TORCH_CUDA_ARCH_LIST set to ``archs`` for the build only; the caller's value comes back after."""
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


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
    with build_lock(directory, lock_timeout()), arch_list(target_archs()):
        load(
            name="kbit_cuda",
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=CXX_FLAGS,
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
