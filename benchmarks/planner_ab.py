"""One side of the planner A/B (benchmarks/bench_planner_ab.sh): time kbit's GEMM as a layer runs it, in a given tree.

    python benchmarks/planner_ab.py --tree DIR --out FILE [--shapes ...] [--m ...] [--k ...] [--seconds S]

The kbit imported is DIR's (put first on sys.path; checked), so this one file times the old tree and the new alike.
It uses nothing of benchmarks/common.py, which imports the kbit beside it. Per cell (shape, bits, M, fp16):

  kbit_us   ``kbit.matmul`` on a weight that holds only its GEMM layout (what kbit's layers hold on CUDA): the
            plan's path, dequantize + cuBLAS included where the planner chooses it (the tree's dequantize of the
            layout, then cuBLAS);
  fused_us  the fused op ``kbit.ops.gemm`` (the fused-only plan; bench_gemm.py's kbit row): timed apart only where
            the layer's plan is dequantize + cuBLAS, else the same launch as kbit_us, which it repeats;
  plan      the tree's plan for the cell, and fused_plan the fused-only one (their fields as the tree names them).

Each timing is a CUDA graph of at least ``--calls`` calls over weight copies that together exceed twice the L2
cache (``kbit.timing``), the median of ``--replays`` replays. ``--seconds``: no (shape, bits) starts after that
many seconds (the two sides' common cells are compared). The file is rewritten after each (shape, bits), and a
cell that fails is listed under ``errors``, so a failure costs its cells only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

SHAPES = "4096->4096,2048->1536,4096->14336,2048->10240,11008->4096,8192->28672,14336->4096,28672->8192,4096->11008"
M_LIST = "1,4,16,32,64,128,256,512,1024,2048,4096"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", required=True, help="the kbit tree to time (its root)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--shapes", default=SHAPES, help="K_in->N_out, comma-separated, timed in this order")
    p.add_argument("--m", default=M_LIST, help="token counts, comma-separated")
    p.add_argument("--k", default="2,3,4,5", help="bit widths, comma-separated")
    p.add_argument("--calls", type=int, default=10, help="calls per CUDA graph at least (default 10)")
    p.add_argument("--replays", type=int, default=5, help="timed graph replays, the median kept (default 5)")
    p.add_argument("--seconds", type=float, default=0.0, help="start no (shape, bits) after this (0: no limit)")
    return p.parse_args(argv)


def import_tree(tree: Path):
    sys.path.insert(0, str(tree))
    import kbit

    if Path(kbit.__file__).resolve().parent.parent != tree:
        raise SystemExit(f"planner_ab: imported kbit from {kbit.__file__}, not from {tree}")
    return kbit


def planner_module(kbit):
    """The tree's planning module: kbit.planner (the cost model) or, before it, kbit.dispatch."""
    try:
        from kbit import planner
        return planner
    except ImportError:
        from kbit import dispatch
        return dispatch


def plan_fields(chosen) -> dict:
    return {name: (value.value if hasattr(value, "value") else value) for name, value in chosen._asdict().items()}


def time_us(call, operands, calls: int, replays: int) -> float:
    """Median microseconds per call of ``call`` over ``operands`` in turn, one CUDA graph of at least ``calls``."""
    from kbit.timing import capture_cuda_graph, replay_seconds

    n = max(calls, len(operands))
    graph = capture_cuda_graph([lambda o=operands[i % len(operands)]: call(o) for i in range(n)])
    us = statistics.median(replay_seconds(graph, timings=replays)) * 1e6 / n
    del graph
    return us


def main(argv=None) -> int:
    args = parse_args(argv)
    tree = Path(args.tree).resolve()
    kbit = import_tree(tree)
    import torch

    planning = planner_module(kbit)
    from kbit.weight import QuantizedWeight

    device = torch.device("cuda")
    dtype = torch.float16
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or 50 * 2**20
    shapes = [tuple(int(v) for v in s.split("->")) for s in args.shapes.split(",") if s]
    m_list = [int(v) for v in args.m.split(",") if v]
    bits_list = [int(v) for v in args.k.split(",") if v]
    rows, errors = [], []
    start = time.monotonic()
    stopped = None

    def write() -> None:
        Path(args.out).write_text(json.dumps({
            "tree": str(tree), "kbit": kbit.__file__, "device": props.name, "args": vars(args), "stopped": stopped,
            "elapsed_s": round(time.monotonic() - start, 1), "errors": errors, "rows": rows}, indent=1))

    for k_in, n_out in shapes:
        for bits in bits_list:
            if args.seconds and rows and time.monotonic() - start > args.seconds:
                stopped = f"{args.seconds:g} s passed before {k_in}->{n_out} K={bits}"
                break
            gen = torch.Generator(device="cuda").manual_seed(k_in * 100003 + n_out + bits)
            W = torch.randn(n_out, k_in, device="cuda", generator=gen, dtype=torch.float32).mul_(0.02).to(dtype)
            qw = kbit.quantize(W, bits)
            del W
            first = tuple(qw.gemm_layout())
            nbytes = sum(t.numel() * t.element_size() for t in first)
            copies = max(2, min(1024, math.ceil(2 * l2 / nbytes) + 1))  # past twice the L2, as kbit tune
            layouts = [first] + [tuple(t.clone() for t in first) for _ in range(copies - 1)]
            layers = [QuantizedWeight.from_gemm_layout(b, a, qw.codebook, qw.scale, bits, qw.shape, dtype)
                      for b, a in layouts]
            padded = qw.in_features_padded
            timed = []
            for M in m_list:
                cell = f"{k_in}->{n_out} K={bits} M={M}"
                try:
                    x = torch.randn(M, k_in, device="cuda", generator=gen, dtype=torch.float32).to(dtype)
                    chosen = planning.gemm_plan(device, n_out, padded, M, bits)
                    fused = planning.gemm_plan(device, n_out, padded, M, bits, fused_only=True)
                    kbit_us = time_us(lambda w, x=x: kbit.matmul(x, w), layers, args.calls, args.replays)
                    fused_us = kbit_us  # the same launch, unless the layer's plan is dequantize + cuBLAS
                    if chosen.path is planning.Path.DEQUANTIZE_CUBLAS:
                        fused_us = time_us(lambda lay, x=x: kbit.ops.gemm(
                            x, lay[0], lay[1], qw.codebook, qw.scale, None, bits, n_out, padded, 0),
                            layouts, args.calls, args.replays)
                except Exception as e:  # noqa: BLE001 - reported, the other cells still run
                    errors.append(f"{cell}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    continue
                rows.append({"shape": f"{k_in}->{n_out}", "dtype": "fp16", "M": M, "K": bits, "kbit_us": kbit_us,
                             "fused_us": fused_us, "plan": plan_fields(chosen), "fused_plan": plan_fields(fused)})
                timed.append(f"M={M}:{kbit_us:.1f}")
            print(f"{k_in}->{n_out} K={bits}: {' '.join(timed)}  [{time.monotonic() - start:.0f} s]", flush=True)
            del layouts, layers, qw
            torch.cuda.empty_cache()
            write()
        if stopped:
            print(f"planner_ab: {stopped}; the rest left out", flush=True)
            break
    write()
    for line in errors:
        print(f"planner_ab: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
