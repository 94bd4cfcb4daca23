"""``python -m kbit demo``: quantize a synthetic Llama-shaped stack at 2..5 bits per weight and report.

The default model is a stack of Llama-style transformer blocks (hidden 1024, intermediate 2816,
grouped-query attention with 4 KV heads of 16): per block the q/k/v/o projections and the
gate/up/down MLP, with normal weights of std 0.02 (the usual initializer). For every bit width it prints
bits per weight, memory saved against fp16, the weights' relative error and SQNR, and the time
of ``kbit.matmul`` against the unquantized matmul (fp16 on CUDA, fp32 on CPU) per block (its
seven projections), at M = 1 (decode) and M = 16 tokens. On CUDA the default stack has 8 layers,
so the fp16 weights (172 MiB) overflow the L2 cache as in real inference, and the whole stack is
timed by CUDA-graph replay; on CPU it has 2 layers and the first block is timed.

On CPU kbit runs its pure-PyTorch reference path (dequantize, then an fp32 matmul), which is
there for correctness, not speed; the fused kernel runs on CUDA.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

from .timing import capture_cuda_graph, replay_seconds
from .weight import QuantizedWeight, matmul, quantize

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_shapes(hidden: int, intermediate: int, kv_dim: int) -> Dict[str, Tuple[int, int]]:
    """[out_features, in_features] of one block's projections."""
    return {
        "q_proj": (hidden, hidden), "k_proj": (kv_dim, hidden), "v_proj": (kv_dim, hidden),
        "o_proj": (hidden, hidden), "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }


def make_weights(layers: int, shapes: Dict[str, Tuple[int, int]], std: float, device, generator) -> List[Dict]:
    out = []
    for _ in range(layers):
        block = {}
        for name in PROJECTIONS:
            w = torch.empty(shapes[name], dtype=torch.float32)
            w.normal_(0.0, std, generator=generator)
            block[name] = w.to(device)
        out.append(block)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device: torch.device, repeats: int, inner: int = 1, warmup: bool = True) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` timings of ``inner`` calls."""
    if warmup:
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def time_cuda_graph(fn, repeats: int, inner: int) -> Tuple[float, bool]:
    """Median seconds per call of ``fn`` replayed from a CUDA graph (no launch or Python overhead).

    Falls back to timing ``fn`` eagerly if it cannot be captured. Returns (seconds, captured).
    """
    try:
        graph = capture_cuda_graph([fn])
    except Exception:  # e.g. a kernel path that cannot be captured: time it eagerly instead
        torch.cuda.synchronize()
        return time_fn(fn, torch.device("cuda"), repeats, inner), False
    return statistics.median(replay_seconds(graph, repeats, inner)), True


def _fmt_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:,.0f}" if us >= 100 else f"{us:.1f}"


def run(
    bits=(2, 3, 4, 5),
    layers: Optional[int] = None,
    hidden: int = 1024,
    intermediate: int = 2816,
    kv_dim: Optional[int] = None,
    device: Optional[str] = None,
    repeats: Optional[int] = None,
    seed: int = 0,
    out=sys.stdout,
) -> List[Dict]:
    """Run the demo and print its table to ``out``; returns one dict of results per bit width.

    ``layers`` defaults to 8 on CUDA (so the fp16 weights overflow the L2 cache, as in real
    inference) and 2 on CPU. Times are per transformer block (its 7 projections): on CUDA the
    whole stack replayed from a CUDA graph, divided by the number of layers; on CPU the first block.
    """
    t_start = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = dev.type == "cuda"
    if layers is None:
        layers = 8 if on_cuda else 2
    kv_dim = kv_dim or max(hidden // 4, 32)
    ref_dtype = torch.float16 if on_cuda else torch.float32
    if repeats is None:
        repeats = 10 if on_cuda else 3
    inner = 20 if on_cuda else 1
    timed_layers = list(range(layers)) if on_cuda else [0]

    shapes = llama_shapes(hidden, intermediate, kv_dim)
    gen = torch.Generator().manual_seed(seed)
    weights = make_weights(layers, shapes, 0.02, dev, gen)
    n_weights = layers * sum(o * i for o, i in shapes.values())
    fp16_bytes = 2 * n_weights

    def p(line: str = "") -> None:
        print(line, file=out, flush=True)

    p(f"kbit demo: synthetic Llama-style stack, {layers} layers x (q/o {hidden}->{hidden}, k/v {hidden}->{kv_dim}, "
      f"gate/up {hidden}->{intermediate}, down {intermediate}->{hidden}), normal(0, 0.02) weights")
    p(f"{n_weights / 1e6:.1f}M weights ({fp16_bytes / 2**20:.1f} MiB in fp16); device: "
      + (torch.cuda.get_device_name(dev) if on_cuda else f"cpu ({torch.get_num_threads()} threads)"))
    if on_cuda:
        p("(the first CUDA call builds kbit's extension if it is not cached yet: that can take a few minutes)")
        quantize(torch.randn(64, 64, device=dev), bits=4)  # load (or build) the extension before timing
        _sync(dev)
    else:
        p("(CPU: kbit runs its reference path, dequantize + fp32 matmul; the fused kernel is CUDA-only)")
    p()

    xs = {M: torch.randn(M, hidden, generator=gen).to(dev, ref_dtype) for M in (1, 16)}
    xs_down = {M: torch.randn(M, intermediate, generator=gen).to(dev, ref_dtype) for M in (1, 16)}

    def inputs(name: str, M: int) -> torch.Tensor:
        return xs_down[M] if name == "down_proj" else xs[M]

    captured_all = True

    def time_block(mm, M: int) -> float:
        """Seconds per block of ``mm(x, layer, name)`` over the timed layers' projections."""
        nonlocal captured_all

        def fn():
            for i in timed_layers:
                for name in PROJECTIONS:
                    mm(inputs(name, M), i, name)

        if on_cuda:
            t, captured = time_cuda_graph(fn, repeats, inner)
            captured_all = captured_all and captured
        else:
            t = time_fn(fn, dev, repeats, inner, warmup=False)
        return t / len(timed_layers)

    # Unquantized baseline.
    base_w = {(i, n): weights[i][n].to(ref_dtype) for i in timed_layers for n in PROJECTIONS}
    base_t = {M: time_block(lambda x, i, n: torch.nn.functional.linear(x, base_w[(i, n)]), M) for M in (1, 16)}
    del base_w

    ref_name = "fp16" if on_cuda else "fp32"
    header = (f"| bits | bits/weight | size MiB | saved vs fp16 | rel. error | SQNR dB | quantize s "
              f"| M=1 kbit µs | M=1 {ref_name} µs | M=1 speedup | M=16 kbit µs | M=16 {ref_name} µs | M=16 speedup |")
    p(header)
    p("|" + "|".join("---:" for _ in range(header.count("|") - 1)) + "|")

    results = []
    worst_check = 0.0
    for b in bits:
        _sync(dev)
        t0 = time.perf_counter()
        qws: List[Dict[str, QuantizedWeight]] = [{n: quantize(w, bits=b) for n, w in blk.items()} for blk in weights]
        _sync(dev)
        t_quant = time.perf_counter() - t0
        nbytes = sum(qw.nbytes for blk in qws for qw in blk.values())
        err2 = sig2 = 0.0
        refs = {}
        for i, (blk_w, blk_q) in enumerate(zip(weights, qws)):
            for name in PROJECTIONS:
                w = blk_w[name]
                w_hat = blk_q[name].dequantize(torch.float32)
                err2 += float(((w - w_hat) ** 2).sum())
                sig2 += float((w * w).sum())
                if i == 0:
                    refs[name] = inputs(name, 16).to(torch.float32) @ w_hat.T
                del w_hat
        rel = math.sqrt(err2 / sig2)
        sqnr = 10 * math.log10(sig2 / err2)

        outputs = {}

        def kbit_mm(x, i, name):
            y = matmul(x, qws[i][name])
            if i == 0:
                outputs[name] = y  # kept for the check below (a CUDA graph updates it on replay)
            return y

        kbit_t = {M: time_block(kbit_mm, M) for M in (1, 16)}
        # Sanity check on the last M=16 outputs: kbit.matmul == x @ dequantize(W).T (up to rounding).
        _sync(dev)
        for name in PROJECTIONS:
            y = outputs[name].to(torch.float32)
            worst_check = max(worst_check, float((y - refs[name]).norm() / refs[name].norm()))
        outputs.clear()

        bpw = 8 * nbytes / n_weights
        row = dict(bits=b, bits_per_weight=bpw, bytes=nbytes, saved_bytes=fp16_bytes - nbytes, rel_error=rel,
                   sqnr_db=sqnr, quantize_s=t_quant, kbit_us_m1=kbit_t[1] * 1e6, ref_us_m1=base_t[1] * 1e6,
                   kbit_us_m16=kbit_t[16] * 1e6, ref_us_m16=base_t[16] * 1e6)
        results.append(row)
        p(f"| {b} | {bpw:.3f} | {nbytes / 2**20:.1f} | {(fp16_bytes - nbytes) / 2**20:.1f} MiB "
          f"({100 * (fp16_bytes - nbytes) / fp16_bytes:.0f}%) | {rel:.4f} | {sqnr:.2f} | {t_quant:.3f} "
          f"| {_fmt_us(kbit_t[1])} | {_fmt_us(base_t[1])} | {base_t[1] / kbit_t[1]:.2f}x "
          f"| {_fmt_us(kbit_t[16])} | {_fmt_us(base_t[16])} | {base_t[16] / kbit_t[16]:.2f}x |")
        del qws

    p()
    if on_cuda:
        how = ("CUDA-graph replay" if captured_all else "eager calls (CUDA-graph capture failed)")
        p(f"Times: µs per block (7 projections), all {layers} layers by {how}, median of {repeats} x {inner}; "
          "speedup = fp16 time / kbit time.")
    else:
        p(f"Times: µs per block (7 projections, the first block), median of {repeats} calls; "
          "speedup = fp32 time / kbit time.")
    p(f"Check: kbit.matmul vs x @ dequantize(W).T in fp32, worst relative error {worst_check:.2e} "
      f"({'fp16 output' if on_cuda else 'fp32'}).")
    p(f"Done in {time.perf_counter() - t_start:.1f} s.")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 5], choices=[2, 3, 4, 5],
                        help="bit widths to try (default: 2 3 4 5)")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (default: 8 on CUDA, 2 on CPU)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default: 1024)")
    parser.add_argument("--intermediate", type=int, default=2816, help="MLP size (default: 2816)")
    parser.add_argument("--kv-dim", type=int, default=None, help="k/v projection size (default: hidden / 4)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats (default: 10 on CUDA, 3 on CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default: 0)")


def main(args: argparse.Namespace) -> int:
    for name in ("layers", "hidden", "intermediate", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise SystemExit(f"kbit demo: --{name} must be positive")
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("kbit demo: --device cuda needs a CUDA device (none is visible)")
    run(bits=args.bits, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
        kv_dim=args.kv_dim, device=args.device, repeats=args.repeats, seed=args.seed)
    return 0
