"""Bandwidth of kbit's quantize, dequantize, repack and dequantize-from-layout kernels vs the measured copy
bandwidth.

    python benchmarks/bench_quant.py                # 64M elements, K = 2..5, all dtypes
    python benchmarks/bench_quant.py --numel 134217728 --k 4

Each op runs on a flat tensor of ``--numel`` elements (repack on a square-ish [N, K] weight of the
same size, dequantize_layout on its GEMM layout), timed as a CUDA graph of several calls alternating between two
input copies (each larger than the L2), median of several replays. Bandwidth = (bytes read + bytes written) / time;
reported with its percentage of the device-to-device copy bandwidth (also read + write), the
practical ceiling. Writes ``quant_<device>.md`` / ``.json`` / ``_summary.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth, dtype_name, env_info, fmt_pct, fmt_us, free_memory, markdown_table, parse_dtypes,
    parse_int_list, text_table, time_graph, write_outputs,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1 << 26, help="elements per tensor (default 64M = 2**26)")
    p.add_argument("--k", default="2,3,4,5", help="bit widths (default 2,3,4,5)")
    p.add_argument("--dtypes", default="fp16,bf16,fp32",
                   help="quantize input / dequantize output dtypes (default fp16,bf16,fp32)")
    p.add_argument("--calls", type=int, default=6, help="calls per CUDA graph (default 6)")
    p.add_argument("--replays", type=int, default=5, help="graph replays, median reported (default 5)")
    p.add_argument("--no-repack", action="store_true", help="skip the repack measurement")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results or $KBIT_BENCH_OUT)")
    args = p.parse_args(argv)
    try:
        args.k_list = parse_int_list(args.k, "--k", allowed=(2, 3, 4, 5))
        args.dtype_list = parse_dtypes(args.dtypes)
    except ValueError as e:
        p.error(str(e))
    if args.numel < 32 * 1024:
        p.error("--numel must be at least 32768")
    return args


def quant_bytes(n: int, k: int, in_bytes: int) -> float:
    """quantize: read n inputs, write k bits + one absmax byte per 32 elements."""
    return n * in_bytes + n * k / 8 + n / 32


def dequant_bytes(n: int, k: int, out_bytes: int) -> float:
    return n * k / 8 + n / 32 + n * out_bytes


def repack_bytes(n: int, k: int) -> float:
    return 2 * (n * k / 8 + n / 32)


def square_shape(n: int) -> tuple[int, int]:
    """An [N, K] with N % 128 == 0, K % 256 == 0 and N * K close to n (for repack)."""
    K = max(256, int(round((n ** 0.5) / 256)) * 256)
    N = max(128, (n // K) // 128 * 128)
    return N, K


def main(argv=None) -> int:
    args = parse_args(argv)
    common.require_cuda("bench_quant.py")
    torch = common.torch
    import kbit.functional
    from kbit import ops

    t_start = time.time()
    env = env_info()
    out_dir = Path(args.out) if args.out else common.out_dir_default()
    print(f"device: {env['device']}, torch {env['torch']}, kbit {env['commit']}", flush=True)
    kbit.quantize(torch.randn(128, 64, device="cuda"), 4)  # build / load the extension first
    torch.cuda.synchronize()
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    n = args.numel
    rows, errors = [], []

    def record(op, k, dtype, nbytes, fn_calls):
        try:
            us = time_graph(fn_calls, replays=args.replays)["us"]
        except Exception as e:  # noqa: BLE001
            errors.append(f"{op} K={k} {dtype}: {type(e).__name__}: {e}")
            print(f"  {op:10s} K={k} {dtype}: FAILED {type(e).__name__}: {e}", flush=True)
            return
        gbs = nbytes / (us * 1e-6)
        rows.append({"op": op, "K": k, "dtype": dtype, "numel": n, "us": us, "bytes": nbytes, "GBps": gbs / 1e9,
                     "pct_copy": 100 * gbs / bw})
        print(f"  {op:10s} K={k} {dtype}: {fmt_us(us):>9s} us  {gbs / 1e9:7.0f} GB/s  {100 * gbs / bw:4.0f}% of copy",
              flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    one = torch.ones((), device="cuda")
    for k in args.k_list:
        cb = kbit.functional.create_normal_float_codebook(k, device="cuda")
        for dtype in args.dtype_list:
            A = [torch.randn(n, device="cuda", generator=gen).to(dtype) for _ in range(2)]
            calls = [(lambda a=A[i % 2]: ops.quantize(a, cb, k, one)) for i in range(args.calls)]
            record("quantize", k, dtype_name(dtype), quant_bytes(n, k, A[0].element_size()), calls)
            del A, calls
            free_memory()
        p, a = ops.quantize(torch.randn(n, device="cuda", generator=gen), cb, k, one)
        stores = [(p, a), (p.clone(), a.clone())]
        for dtype in args.dtype_list:
            calls = [(lambda s=stores[i % 2], dt=dtype: ops.dequantize(s[0], s[1], cb, k, n, dt, one))
                     for i in range(args.calls)]
            record("dequantize", k, dtype_name(dtype), dequant_bytes(n, k, torch.empty(0, dtype=dtype).element_size()),
                   calls)
            del calls
            free_memory()
        del stores, p, a
        if not args.no_repack:
            N, K = square_shape(n)
            p, a = ops.quantize(torch.randn(N * K, device="cuda", generator=gen), cb, k, one)
            stores = [(p, a), (p.clone(), a.clone())]
            calls = [(lambda s=stores[i % 2]: ops.repack(s[0], s[1], k, N, K)) for i in range(args.calls)]
            record("repack", k, f"[{N}x{K}]", repack_bytes(N * K, k), calls)
            layouts = [ops.repack(s[0], s[1], k, N, K) for s in stores]
            del stores, p, a, calls
            free_memory()
            for dtype in args.dtype_list:  # a kbit layer's dense weight on the GPU: straight from its layout
                calls = [(lambda l=layouts[i % 2], dt=dtype: ops.dequantize_layout(l[0], l[1], cb, k, N, K, dt, one))
                         for i in range(args.calls)]
                record("dequantize_layout", k, dtype_name(dtype),
                       dequant_bytes(N * K, k, torch.empty(0, dtype=dtype).element_size()), calls)
                del calls
                free_memory()
            del layouts
        free_memory()

    data = {"env": env, "copy_bandwidth": bw, "numel": n, "rows": rows, "errors": errors,
            "args": {"k": args.k_list, "dtypes": [dtype_name(d) for d in args.dtype_list], "calls": args.calls,
                     "replays": args.replays}, "elapsed_s": round(time.time() - t_start, 1)}
    headers = ["op", "K", "dtype", "µs", "GB/s", "% of copy BW"]
    body = [[r["op"], r["K"], r["dtype"], fmt_us(r["us"]), f"{r['GBps']:.0f}", fmt_pct(r["pct_copy"])] for r in rows]
    md = "\n".join([
        f"# kbit quantize / dequantize / repack bandwidth: {env.get('device', '?')}", "",
        f"{env['date']}; torch {env['torch']} (CUDA {env['torch_cuda']}); kbit commit {env['commit']}.", "",
        f"{n:,} elements per tensor. Copy bandwidth **{bw / 1e12:.2f} TB/s** (read + write). Bandwidth = (bytes read "
        "+ bytes written) / time, CUDA-graph replay, median.", "",
        markdown_table(headers, body, align="lrlrrr"), "",
    ] + (["## Errors", ""] + [f"- `{e}`" for e in errors] + [""] if errors else []))
    stem = f"quant_{common.device_tag(env['device'])}"
    md_path, js_path = write_outputs(out_dir, stem, md, data)

    # compact summary: % of copy bandwidth per op/dtype (rows) and K (columns)
    ks = args.k_list
    keys = list(dict.fromkeys((r["op"], r["dtype"] if r["op"] != "repack" else "-") for r in rows))
    srows = []
    for op, dt in keys:
        cells = [f"{op} {dt}" if dt != "-" else op]
        for k in ks:
            r = next((r for r in rows if r["op"] == op and r["K"] == k and (dt == "-" or r["dtype"] == dt)), None)
            cells.append(fmt_pct(r["pct_copy"]) if r else "-")
        srows.append(cells)
    summary = (f"kbit quantize/dequantize/repack on {env['device']}: % of copy bandwidth "
               f"({bw / 1e12:.2f} TB/s), {n / 2**20:.0f}M elements\n")
    summary += text_table(["op"] + [f"K={k}" for k in ks], srows)
    if errors:
        summary += f"\n{len(errors)} measurement(s) failed (see {md_path.name})"
    (out_dir / f"{stem}_summary.txt").write_text(summary + "\n")
    print(f"wrote {md_path}, {js_path} in {time.time() - t_start:.0f}s\n", flush=True)
    print(summary)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
