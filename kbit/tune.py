"""``python -m kbit tune``: time every GEMM path on this GPU and cache the results for the planner.

For each bit width, shape and token count, every fused path that runs here (``kbit.dispatch.fused_configs``: the
configuration the planner would run for it) and dequantize + cuBLAS (what ``kbit.matmul`` does on that path) are
timed from CUDA graphs on weight copies rotated past twice the L2 cache, so the weights stream from memory as in
inference. A fused path whose output disagrees with dequantize + cuBLAS is left out. The times go to the tuned
dispatch cache (``kbit.tune_cache``); from then on ``kbit.matmul`` plans those shapes from them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import warnings

import torch

DEFAULT_SHAPES = ("8192->28672,28672->8192,14336->4096,4096->14336,11008->4096,4096->11008,4096->4096,2048->10240,"
                  "2048->1536")
DEFAULT_TOKENS = "1,8,16,32,64,128,192,256,384,512,768,1024,2048,4096"
AGREEMENT = 1e-2  # relative Frobenius error between a fused path's output and dequantize + cuBLAS's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bits", default="2,3,4,5", help="bit widths, comma-separated (default: 2,3,4,5)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="in_features->out_features, comma-separated; plan-time lookups match these exactly "
                             "(default: the seeds' nine shapes)")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS,
                        help="token counts M to time; a call with M tokens uses the first one >= M "
                             f"(default: {DEFAULT_TOKENS})")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="activation dtype (default: fp16)")
    parser.add_argument("--repeats", type=int, default=5, help="timed graph replays per measurement (default: 5)")


def _int_list(text: str, what: str) -> list:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise SystemExit(f"kbit tune: {what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"kbit tune: {what} must be positive integers, got {text!r}")
    return values


def _shapes(text: str) -> list:
    shapes = []
    for item in text.replace(" ", "").split(","):
        parts = item.replace("x", "->").split("->")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"kbit tune: a shape is in_features->out_features, e.g. 4096->14336; got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def _rotation(first, nbytes: int, l2_bytes: int) -> list:
    """``first`` and clones of it: enough that one pass over them moves more than twice the L2 cache."""
    copies = max(2, min(64, math.ceil(2 * l2_bytes / max(nbytes, 1)) + 1))
    return [first] + [tuple(t.clone() for t in first) for _ in range(copies - 1)]


def _time_us(call, operands, repeats: int) -> float:
    """Median microseconds per call of ``call`` over ``operands``, one CUDA graph calling it on each in turn."""
    from .timing import capture_cuda_graph, replay_seconds

    graph = capture_cuda_graph([lambda o=o: call(o) for o in operands])
    return statistics.median(replay_seconds(graph, timings=repeats)) * 1e6 / len(operands)


def tune_shape(facts, bits: int, in_features: int, out_features: int, tokens: list, dtype, repeats: int, log) -> dict:
    """The cache entry of one shape: each path's microseconds per call at each token count (None: not timed)."""
    from . import dispatch
    from . import ops
    from ._build import cuda_ext
    from .formats import padded_in_features
    from .weight import QuantizedWeight, quantize

    ext = cuda_ext()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or 50 * 2**20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = quantize(torch.randn(out_features, in_features, device=device, dtype=dtype) * 0.02, bits)
    in_features_padded = padded_in_features(in_features)
    layout = qw.gemm_layout()
    layouts = _rotation(tuple(layout), sum(t.numel() * t.element_size() for t in layout), l2)
    storages = _rotation((qw.packed, qw.absmax), qw.packed.numel() * 4 + qw.absmax.numel(), l2)
    weights = [QuantizedWeight(p, a, qw.codebook, qw.scale, bits, qw.shape, dtype) for p, a in storages]
    us = {path.value: [] for path in dispatch.Path}
    for M in tokens:
        x = torch.randn(M, in_features, device=device, dtype=dtype)

        def dequantize_cublas(w, x=x):
            return torch.nn.functional.linear(x, w.dequantize(dtype))

        reference = dequantize_cublas(weights[0]).float()
        us[dispatch.Path.DEQUANTIZE_CUBLAS.value].append(_time_us(dequantize_cublas, weights, repeats))
        runs = dispatch.fused_configs(facts.device, facts.configs, out_features, in_features, M, bits)
        for path in (dispatch.Path.MMA_SYNC, dispatch.Path.K_SPLIT, dispatch.Path.WGMMA, dispatch.Path.WARP_SPECIALIZED):
            config = runs.get(path)
            time = None
            if config is not None:
                def fused(lay, x=x, c=config):
                    return ext.gemm(x, lay[0], lay[1], qw.codebook, qw.scale, None, bits, out_features, in_features_padded, 0, c.mb,
                                    c.wgmma_tiles, c.k_split, c.ws_tokens, ops.weights_settled(*lay, qw.codebook))

                error = float((fused(layouts[0]).float() - reference).norm() / reference.norm().clamp_min(1e-30))
                if error <= AGREEMENT:
                    time = _time_us(fused, layouts, repeats)
                else:
                    log(f"  {path.value} at M = {M}: output differs from dequantize + cuBLAS by {error:.2g}; "
                        "left out")
            us[path.value].append(time)
        timed = {name: times[-1] for name, times in us.items() if times[-1] is not None}
        fastest = min(timed, key=timed.get)
        log(f"  {bits} bits {in_features}->{out_features} M = {M}: {fastest} {timed[fastest]:.1f} us")
    del layouts, storages, weights, qw
    torch.cuda.empty_cache()
    return {"bits": bits, "out_features": out_features, "in_features": in_features, "tokens": list(tokens), "us": us}


def main(args: argparse.Namespace) -> int:
    from . import dispatch, tune_cache

    if not torch.cuda.is_available():
        print("kbit tune: no CUDA device is visible; the planner's crossovers are measured on the GPU that runs them",
              file=sys.stderr)
        return 2
    bits_list = _int_list(args.bits, "--bits")
    if any(b not in (2, 3, 4, 5) for b in bits_list):
        raise SystemExit(f"kbit tune: --bits must be among 2, 3, 4, 5, got {args.bits!r}")
    shapes = _shapes(args.shapes)
    tokens = sorted(set(_int_list(args.tokens, "--tokens")))
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    facts = dispatch.device_facts(torch.device("cuda"))

    def log(line: str) -> None:
        print(line, flush=True)

    log(f"kbit tune: {facts.device.name}, {len(bits_list)} bit widths x {len(shapes)} shapes x {len(tokens)} token "
        f"counts")
    entries = [tune_shape(facts, bits, k_in, n_out, tokens, dtype, args.repeats, log)
               for bits in bits_list for k_in, n_out in shapes]
    path = tune_cache.save(facts.device, entries)
    dispatch.forget()
    log(f"kbit tune: wrote {path}")
    _report(facts, entries, log)
    return 0


def _report(facts, entries: list, log) -> None:
    """Per shape and token count: the fastest path against what the crossover table alone picks."""
    from . import dispatch

    for e in entries:
        log(f"{e['bits']} bits {e['in_features']}->{e['out_features']}:")
        for i, M in enumerate(e["tokens"]):
            times = {name: t[i] for name, t in e["us"].items() if t[i] is not None}
            fastest = min(times, key=times.get)
            table = dispatch.plan(facts.device, facts.configs, e["out_features"], e["in_features"], M, e["bits"])
            slower = times.get(table.path.value, 0) / times[fastest]
            note = f"  (the table's {table.path.value}: {slower:.2f}x slower)" if slower > 1 else ""
            log(f"  M = {M:>5}: {fastest} {times[fastest]:.1f} us{note}")
