"""Shared benchmark helpers: device facts, copy bandwidth, CUDA-graph timing, roofline, output files.

Timing rules (docs/PERFORMANCE.md#method): every measurement is a CUDA graph holding many calls,
replayed several times; the median replay time divided by the number of calls is the per-call
time. Calls rotate over copies of their weights whose total size exceeds twice the L2 cache, so
weights stream from HBM as they do in real inference.

Only ``torch`` is needed; everything here except the timing functions also works without a GPU
(the pure helpers are used by ``--help`` paths and unit-checked on CPU).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
if str(REPO) not in sys.path:  # run as `python benchmarks/bench_x.py` from anywhere
    sys.path.insert(0, str(REPO))

from kbit.formats import storage_spec  # noqa: E402
from kbit.timing import capture_cuda_graph, in_step, in_step_time, replay_seconds  # noqa: E402


# ----------------------------------------------------------------------------- pure helpers
def device_tag(name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200' (safe in file names)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "unknown"


def parse_shape(text: str) -> tuple[int, int]:
    """'8192->28672', '8192x28672' or '8192:28672' (K_in -> N_out) -> (K_in, N_out)."""
    parts = re.split(r"\s*(?:->|→|x|X|:|,)\s*", text.strip())
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"shape must look like K_in->N_out (e.g. 4096->14336), got {text!r}")
    k_in, n_out = int(parts[0]), int(parts[1])
    if k_in <= 0 or n_out <= 0:
        raise ValueError(f"shape dimensions must be positive, got {text!r}")
    return k_in, n_out


def shape_name(k_in: int, n_out: int) -> str:
    return f"{k_in}->{n_out}"


def parse_int_list(text: str, name: str, allowed: Optional[Iterable[int]] = None) -> list[int]:
    try:
        vals = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of integers, got {text!r}") from None
    if not vals:
        raise ValueError(f"{name} is empty")
    if allowed is not None:
        allowed = set(allowed)
        bad = [v for v in vals if v not in allowed]
        if bad:
            raise ValueError(f"{name}: {bad} not in {sorted(allowed)}")
    return vals


def kbit_weight_bytes(n_out: int, k_in: int, bits: int) -> float:
    """Bytes of a ``bits``-bit [n_out, k_in] weight in kbit's storage format (``kbit.formats.storage_spec``).

    The floor's byte count (docs/PERFORMANCE.md#performance-model)."""
    total = 0
    for key in ("packed", "absmax", "codebook", "scale"):
        dtype, shape = storage_spec(key, bits, (n_out, k_in))
        total += math.prod(shape) * dtype.itemsize
    return float(total)


def gemm_bytes(m: int, k_in: int, n_out: int, weight_bytes: float, act_bytes: int = 2) -> float:
    """Bytes a GEMM must move at least: the weight once, x read once, y written once."""
    return weight_bytes + m * k_in * act_bytes + m * n_out * act_bytes


def floor_us(nbytes: float, bandwidth: float) -> float:
    """Time to move nbytes at bandwidth (bytes/s), in microseconds."""
    return nbytes / bandwidth * 1e6


def copies_for(bytes_per_copy: float, l2_bytes: int, factor: float = 2.0, min_copies: int = 2,
               max_copies: int = 4096) -> int:
    """How many weight copies make the rotation set exceed ``factor`` times the L2 size."""
    need = math.ceil(factor * l2_bytes / max(bytes_per_copy, 1.0)) + 1
    return int(min(max(min_copies, need), max_copies))


def rotated_copies(first, l2_bytes: int, nbytes: Optional[int] = None) -> list:
    """``first`` (a tensor or a tuple of tensors) and clones of it, enough that one pass over them moves more than twice
    the L2 cache (``nbytes`` per copy: all of first's bytes unless given)."""
    tensors = first if isinstance(first, tuple) else (first,)
    n = copies_for(nbytes if nbytes is not None else sum(t.numel() * t.element_size() for t in tensors), l2_bytes)
    return [first] + [tuple(t.clone() for t in tensors) if isinstance(first, tuple) else first.clone()
                      for _ in range(n - 1)]


def fmt_us(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def fmt_ratio(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:.2f}x"


def fmt_pct(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:.0f}%"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence], align: Optional[str] = None) -> str:
    """A GitHub markdown table. ``align``: one char per column, 'l' or 'r' (default: first l, rest r)."""
    align = align or ("l" + "r" * (len(headers) - 1))
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A compact fixed-width table for the terminal."""
    cols = [[str(h)] + [str(r[i]) for r in rows] for i, h in enumerate(headers)]
    widths = [max(len(c) for c in col) for col in cols]
    out = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    for r in rows:
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def geomean(vals: Iterable[float]) -> Optional[float]:
    v = [x for x in vals if x is not None and math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


def git_commit() -> str:
    """The commit measured: $KBIT_BENCH_COMMIT when set (a copy of the tree whose git metadata is not its own, as on
    a remote runner), else git's HEAD, "+dirty" with uncommitted changes."""
    if os.environ.get("KBIT_BENCH_COMMIT"):
        return os.environ["KBIT_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except Exception:
        return "unknown"


def env_info() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "commit": os.environ.get("KBIT_COMMIT") or git_commit(), "host": platform.node(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), sm=f"{p.major}.{p.minor}", num_sms=p.multi_processor_count,
                    l2_bytes=l2_bytes(), total_memory_gib=round(p.total_memory / 2**30, 1))
    return info


def write_outputs(out_dir: Path, stem: str, markdown: str, data: dict) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(markdown)
    js.write_text(json.dumps(data, indent=1, default=str))
    return md, js


# ----------------------------------------------------------------------------- GPU facts and timing
def l2_bytes() -> int:
    p = torch.cuda.get_device_properties(0)
    l2 = getattr(p, "L2_cache_size", 0) or getattr(p, "l2_cache_size", 0)
    return int(l2) if l2 else 50 * 2**20  # H100/H200: 50 MiB


def sync() -> None:
    torch.cuda.synchronize()


def time_graph(calls: Sequence[Callable[[], object]], replays: int = 5, warmup_calls: int = 2) -> dict:
    """Per-call time (µs) of ``calls`` captured in order into one CUDA graph (``kbit.timing``): the median and
    min of ``replays`` replay times divided by ``len(calls)``."""
    graph = capture_cuda_graph(calls, warmup_calls=warmup_calls)
    times = [t * 1e6 / len(calls) for t in replay_seconds(graph, timings=replays)]
    del graph
    return {"us": statistics.median(times), "min_us": min(times), "replays": replays, "calls": len(calls)}


def time_in_step(calls: Sequence[Callable[[], object]], written: torch.Tensor, replays: int = 5,
                 warmup_calls: int = 2) -> dict:
    """Per-call time (µs) of ``calls`` each run just after a kernel that writes ``written`` (their input), as in a
    decoder step (``kbit.timing.in_step``): the graph of the pairs less the graph of the writes alone; ``write_us``:
    one write's time."""
    pairs, writes = in_step(calls, written)
    both = time_graph(pairs, replays=replays, warmup_calls=warmup_calls)
    alone = time_graph(writes, replays=replays, warmup_calls=warmup_calls)
    return {"us": in_step_time(both["us"], alone["us"]), "min_us": in_step_time(both["min_us"], alone["min_us"]),
            "replays": replays, "calls": len(calls), "write_us": alone["us"]}


def time_rotated(fn: Callable[[object], object], copies: Sequence, calls: int, replays: int) -> float:
    """Median µs per call of ``fn`` over ``copies`` in turn, one CUDA graph of at least ``calls`` calls."""
    graph_calls = [(lambda w=copies[i % len(copies)]: fn(w)) for i in range(max(calls, len(copies)))]
    return time_graph(graph_calls, replays=replays)["us"]


def time_eager(fn: Callable[[], object], iters: int = 10, warmup: int = 2) -> float:
    """Median per-call µs of an eager function (for work too large or unsuitable for a graph)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2**30, iters: int = 10) -> float:
    """Measured device-to-device copy rate in bytes/s, counting bytes read + bytes written."""
    free, _ = torch.cuda.mem_get_info()
    nbytes = int(min(nbytes, free // 4)) // 256 * 256
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    us = time_eager(lambda: dst.copy_(src), iters=iters, warmup=3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (us * 1e-6)


def free_memory() -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA device (torch {torch.__version__}, cuda available: False)", file=sys.stderr)
        raise SystemExit(2)


def parse_dtypes(text: str) -> list[torch.dtype]:
    names = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
    out = []
    for t in text.replace(" ", "").split(","):
        if t not in names:
            raise ValueError(f"unknown dtype {t!r}; use fp16, bf16 or fp32")
        out.append(names[t])
    return out


def dtype_name(d: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(d, str(d))


def out_dir_default() -> Path:
    return Path(os.environ.get("KBIT_BENCH_OUT") or RESULTS_DIR)
