"""Where a GPU sits idle in a profiled run, and what the host did meanwhile: reads a Chrome trace that
``bench_e2e.py --profile --trace DIR`` or ``bench_tp.py --profile --trace DIR`` wrote (torch profiler, CPU and CUDA)
and prints the idle time between kernels, summed by the kernel groups on either side, and the largest gaps with the
host calls running through them.

    python benchmarks/trace_gaps.py TRACE.json [--top 12] [--min-us 2]

Idle is measured on the device as a whole (kernels of every stream merged): a gap is a span no kernel runs in. A
gap that a ``cudaGraphLaunch`` or kernel launch ends was the host's (the GPU waited for the launch); one in the middle
of a graph's replay is the graph's own dependency latency.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import kernel_group  # noqa: E402


def load_events(path) -> tuple:
    """(kernels, host calls) of a Chrome trace: each (start µs, end µs, name), sorted by start. Kernels are the
    ``kernel`` events; host calls the CUDA runtime and driver calls (launches, graph launches, waits)."""
    events = json.loads(Path(path).read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels, host = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", ""))
        category = e.get("cat", "")
        if category == "kernel":
            kernels.append(span)
        elif category in ("cuda_runtime", "cuda_driver"):
            host.append(span)
    return sorted(kernels), sorted(host)


def gaps(kernels: list, min_us: float = 0.0) -> list:
    """The idle spans between kernels (all streams merged), each (start, end, kernel before, kernel after), of at
    least ``min_us``."""
    out, busy_until, last = [], None, None
    for start, end, name in kernels:
        if busy_until is not None and start - busy_until >= min_us and start > busy_until:
            out.append((busy_until, start, last, name))
        if busy_until is None or end > busy_until:
            busy_until, last = end, name
    return out


def summarize(kernels: list, host: list, min_us: float = 0.0, top: int = 12) -> dict:
    """Span, kernel time (merged), idle, idle by (group before -> group after), and the ``top`` largest gaps with
    the host calls that overlap them."""
    if not kernels:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "by_groups": {}, "largest": []}
    span = max(end for _, end, _ in kernels) - kernels[0][0]
    found = gaps(kernels, min_us)
    idle = sum(end - start for start, end, _, _ in gaps(kernels))
    by_groups = defaultdict(float)
    for start, end, before, after in found:
        by_groups[f"{kernel_group(before)} -> {kernel_group(after)}"] += end - start
    largest = []
    for start, end, before, after in sorted(found, key=lambda g: g[0] - g[1])[:top]:
        calls = sorted({name for s, e, name in host if s < end and e > start})
        largest.append({"us": end - start, "before": before[:100], "after": after[:100], "host_calls": calls})
    return {"span_us": span, "busy_us": span - idle, "idle_us": idle,
            "by_groups": dict(sorted(by_groups.items(), key=lambda kv: -kv[1])), "largest": largest}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--min-us", type=float, default=2.0, help="gaps shorter than this are left out of the lists")
    args = p.parse_args(argv)
    s = summarize(*load_events(args.trace), min_us=args.min_us, top=args.top)
    print(f"span {s['span_us']:.0f} us, kernels {s['busy_us']:.0f}, idle {s['idle_us']:.0f}")
    print(f"idle in gaps >= {args.min_us:g} us, by the kernel groups on either side:")
    for pair, us in s["by_groups"].items():
        print(f"  {us:9.0f} us  {pair}")
    print("largest gaps:")
    for g in s["largest"]:
        host = ", ".join(g["host_calls"]) or "-"
        print(f"  {g['us']:7.1f} us  {g['before'][:50]} -> {g['after'][:50]}  host: {host}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
