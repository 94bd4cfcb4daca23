"""Benchmark kbit's fused dequantize + GEMM against cuBLAS fp16 and the other peers (docs/PERFORMANCE.md#method).

    python benchmarks/bench_gemm.py                 # default sweep, M = 1..4096 (~8 min of GPU time)
    python benchmarks/bench_gemm.py --quick         # small subset (~1-2 min)
    python benchmarks/bench_gemm.py --shapes 4096->14336,8192->28672 --m 1,16 --k 4 --dtypes fp16,bf16
    python benchmarks/bench_gemm.py --render A.json B.json   # one result from runs measured apart

Method: first the device-to-device copy bandwidth is measured (bytes read + written per second).
Every timing is a CUDA graph of R calls, each call on a different copy of its weights, the copies together
exceeding twice the L2 cache; after 30 ms of untimed replays the graph is replayed several times and the
median replay time / R is the per-call time. Reported per (shape, M, K): µs, % of the roofline (floor = (k-bit
weight bytes + x bytes + y bytes) / copy bandwidth; 100% = at the floor), the time of a device-to-device copy
moving the same bytes (half read, half written; timed the same way: what a memory-only kernel of that size
reaches in this harness, launch and tail included), speedup over cuBLAS ``F.linear`` in the same dtype (fp16 by
default) timed the same way, the share of the call's limit (``add_limits``: the floor, or the FLOPs at cuBLAS's own
rate on the shape at 4096 tokens where that is longer), and the path kbit's planner takes for the call (``fused`` or
``dequantize_cublas``) with that path's measured time. Peers, when available: dequantize + cuBLAS (as a kbit layer on
the GPU runs it: ``kbit.ops.dequantize_layout`` from the GEMM layout, then ``F.linear``), torch int4
(``aten._weight_int4pack_mm``, group size 128; it may only accept bf16 activations), bitsandbytes NF4 and gemlite
int4. Writes ``gemm_<device>.md`` / ``.json`` / ``.png`` and ``gemm_<device>_summary.txt`` under ``--out`` (default
benchmarks/results): the device's one current result set.

A results JSON lists its ``runs`` (each one's env, commit, date, copy bandwidth and arguments) and its ``rows``,
each naming the run that measured it. ``--render`` of several JSONs merges their rows into ``gemm_<device>.*``
(a sweep measured in parts, e.g. ``--m 1,4,8,16 --tag decode`` and ``--m 32,...,4096 --tag prefill``), keeping
every run's provenance; it refuses runs of different devices and a cell (shape, dtype, M, K) measured twice.

Shapes are written K_in->N_out (nn.Linear(in_features=K_in, out_features=N_out)).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/common.py; puts the repo root on sys.path)
from common import (  # noqa: E402
    copies_for, copy_bandwidth, dtype_name, env_info, floor_us, fmt_pct, fmt_ratio, fmt_us, free_memory, gemm_bytes,
    geomean, kbit_weight_bytes, l2_bytes, markdown_table, parse_dtypes, parse_int_list, parse_shape, shape_name,
    text_table, time_graph, write_outputs,
)

# The seed shapes (K_in -> N_out): the four of the quick subset first.
DEFAULT_SHAPES = ["8192->28672", "14336->4096", "4096->4096", "2048->1536", "4096->14336", "28672->8192",
                  "11008->4096", "4096->11008", "2048->10240"]
QUICK_SHAPES = ["8192->28672", "14336->4096", "4096->4096", "2048->1536"]
DEFAULT_M = [1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
QUICK_M = [1, 16, 64]
DEFAULT_K = [2, 3, 4, 5]
PEERS = ("dequant", "int4", "bnb", "gemlite")
INT4_GROUP = 128
SUMMARY_M = (1, 16, 64, 256)
# The token count at which cuBLAS's rate on a shape stands for the best dense rate the GPU reaches on it.
LIMIT_M = 4096


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Shapes are K_in->N_out. Results go to --out as gemm_<device>.{md,json,png}.")
    p.add_argument("--shapes", help=f"comma-separated K_in->N_out list (default: {','.join(DEFAULT_SHAPES)})")
    p.add_argument("--m", help=f"comma-separated M values (default: {','.join(map(str, DEFAULT_M))})")
    p.add_argument("--k", help="comma-separated bit widths in 2..5 (default: 2,3,4,5)")
    p.add_argument("--dtypes", default="fp16", help="activation dtypes: fp16 and/or bf16 (default: fp16)")
    p.add_argument("--quick", action="store_true",
                   help=f"small subset (~1-2 min): shapes {','.join(QUICK_SHAPES)}, M {QUICK_M}, "
                        "dequant+cuBLAS peer at K=4 only")
    p.add_argument("--full", action="store_true", help="the default sweep (accepted for symmetry with --quick)")
    p.add_argument("--out", default=None, help="output folder (default: benchmarks/results or $KBIT_BENCH_OUT)")
    p.add_argument("--tag", default="", help="suffix of the output files' names, gemm_<device>_<tag>.*, for a run "
                                             "that is not the device's whole set (a part to merge with --render)")
    p.add_argument("--calls", type=int, default=20, help="minimum calls per CUDA graph (default 20)")
    p.add_argument("--replays", type=int, default=7, help="graph replays; the median is reported (default 7)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"peers besides cuBLAS to time, comma-separated from {','.join(PEERS)} (or 'none')")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    p.add_argument("--render", metavar="JSON", nargs="+", default=None,
                   help="no timing: write the markdown of a results JSON of this script again beside it, with the "
                        "derived columns of this version (the limit's share); prints its summary. Several JSONs of "
                        "one device: their rows merged into gemm_<device>.{md,json} in --out (default: the first "
                        "JSON's folder), each run's provenance kept")
    p.add_argument("--no-check", action="store_true", help="skip the per-(shape, K) accuracy spot check")
    p.add_argument("--mem-fraction", type=float, default=0.5,
                   help="cap on the free GPU memory one rotation set may use (default 0.5)")
    args = p.parse_args(argv)
    if args.quick and args.full:
        p.error("--quick and --full are exclusive")
    try:
        args.shape_list = [parse_shape(s) for s in (args.shapes.split(",") if args.shapes else
                                                     (QUICK_SHAPES if args.quick else DEFAULT_SHAPES))]
        args.m_list = parse_int_list(args.m, "--m") if args.m else list(QUICK_M if args.quick else DEFAULT_M)
        args.k_list = parse_int_list(args.k, "--k", allowed=(2, 3, 4, 5)) if args.k else list(DEFAULT_K)
        args.dtype_list = parse_dtypes(args.dtypes)
        peers = [] if args.peers.strip() in ("", "none") else [s.strip() for s in args.peers.split(",")]
        bad = [s for s in peers if s not in PEERS]
        if bad:
            raise ValueError(f"--peers: unknown {bad}; choose from {PEERS}")
        args.peer_list = peers
    except ValueError as e:
        p.error(str(e))
    if any(m < 1 for m in args.m_list):
        p.error("--m values must be >= 1")
    if any(d not in (common.torch.float16, common.torch.bfloat16) for d in args.dtype_list):
        p.error("--dtypes: the GEMM takes fp16 or bf16 activations")
    return args


# ----------------------------------------------------------------------------- peers
class Peer:
    """A method to time: ``prepare(W)`` builds one weight copy; ``call(x, w)`` runs one product."""

    name = "?"

    def __init__(self, dtype):
        self.dtype = dtype
        self.x_dtype = dtype
        self.note = ""

    def prepare(self, W):
        raise NotImplementedError

    def nbytes(self, w) -> int:
        raise NotImplementedError

    def clone(self, w):
        raise NotImplementedError

    def call(self, x, w):
        raise NotImplementedError


class Cublas(Peer):
    name = "cublas"

    def prepare(self, W):
        return W.to(self.dtype).contiguous()

    def nbytes(self, w):
        return w.numel() * w.element_size()

    def clone(self, w):
        return w.clone()

    def call(self, x, w):
        return common.torch.nn.functional.linear(x, w)


class KbitFused(Peer):
    """kbit's fused GEMM, called through the custom op on the GEMM layout (what kbit.matmul runs)."""

    name = "kbit"

    def __init__(self, dtype, k):
        super().__init__(dtype)
        self.k = k

    def quantize(self, W):
        import kbit

        from kbit.weight import padded_in_features

        self.qw = kbit.quantize(W, self.k)
        self.kdim = padded_in_features(self.qw.shape[1])

    def prepare(self, W):
        self.quantize(W)
        return self.qw.gemm_layout()

    def nbytes(self, w):
        return sum(t.numel() * t.element_size() for t in w)

    def clone(self, w):
        return tuple(t.clone() for t in w)

    def call(self, x, w):
        import kbit

        qw = self.qw
        return kbit.ops.gemm(x, w[0], w[1], qw.codebook, qw.scale, None, qw.bits, qw.shape[0], self.kdim, 0)


class DequantCublas(KbitFused):
    """Dequantize to the activation dtype, then cuBLAS: the unfused path as a kbit layer on the GPU runs it (its
    weight holds only the GEMM layout, dequantized straight from it in one pass; rotates the layout)."""

    name = "dequant"

    def call(self, x, w):
        import kbit

        qw = self.qw
        N, K = qw.shape
        wh = kbit.ops.dequantize_layout(w[0], w[1], qw.codebook, qw.bits, N, self.kdim, self.dtype, qw.scale)
        if self.kdim != K:  # as QuantizedWeight._dequantize gives it
            wh = wh[:, :K].contiguous()
        return common.torch.nn.functional.linear(x, wh)


class TorchInt4(Peer):
    """torch's tinygemm int4 (``aten._weight_int4pack_mm``), group size 128, random weights."""

    name = "int4"

    def prepare(self, W):
        torch = common.torch
        N, K = W.shape
        if K % INT4_GROUP:
            raise RuntimeError(f"K={K} not a multiple of the group size {INT4_GROUP}")
        inner = next((t for t in (8, 4, 2) if K % (t * 16) == 0), None)
        if inner is None or N % 8:
            raise RuntimeError(f"shape N={N}, K={K} unsupported by _convert_weight_to_int4pack")
        q = torch.randint(0, 16, (N, K), dtype=torch.int32, device=W.device)
        try:  # torch >= 2.5: uint8 [N, K/2], two nibbles per byte
            w = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), inner)
        except RuntimeError:  # older torch: int32 [N, K]
            w = torch.ops.aten._convert_weight_to_int4pack(q, inner)
        # [K / group, N, 2] (scale, zero) in the activation dtype
        self.sz = (torch.rand(K // INT4_GROUP, N, 2, device=W.device) * 0.01).to(torch.bfloat16)
        self.note = f"group {INT4_GROUP}, innerKTiles {inner}"
        return w

    def nbytes(self, w):
        return w.numel() * w.element_size()

    def clone(self, w):
        return w.clone()

    def choose_dtype(self, x):
        """The CUDA kernel may take bf16 only: try the row's dtype, else fall back to bf16."""
        torch = common.torch
        for dt in (self.dtype, torch.bfloat16):
            try:
                torch.ops.aten._weight_int4pack_mm(x.to(dt), self._probe_w, INT4_GROUP, self.sz.to(dt))
                torch.cuda.synchronize()
                self.x_dtype = dt
                self.sz = self.sz.to(dt)
                if dt != self.dtype:
                    self.note += f"; runs with {dtype_name(dt)} activations"
                return dt
            except RuntimeError:
                continue
        raise RuntimeError("_weight_int4pack_mm rejected both fp16 and bf16 activations")

    def call(self, x, w):
        return common.torch.ops.aten._weight_int4pack_mm(x, w, INT4_GROUP, self.sz)


class BnbNF4(Peer):
    name = "bnb"

    def prepare(self, W):
        import bitsandbytes as bnb  # noqa: F401
        import bitsandbytes.functional as bf

        wq, state = bf.quantize_4bit(W.to(self.dtype).contiguous(), quant_type="nf4")
        self.state = state
        import bitsandbytes

        self.note = f"bitsandbytes {getattr(bitsandbytes, '__version__', '?')} nf4 (blocksize {state.blocksize})"
        return wq

    def nbytes(self, w):
        return w.numel() * w.element_size()

    def clone(self, w):
        return w.clone()

    def call(self, x, w):
        import bitsandbytes as bnb

        return bnb.matmul_4bit(x, w.t(), quant_state=self.state)


class Gemlite(Peer):
    name = "gemlite"

    def prepare(self, W):
        torch = common.torch
        import gemlite  # noqa: F401
        from gemlite.helper import A16W4_HQQ_INT

        N, K = W.shape
        wq = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=W.device)
        scales = (torch.rand(N, K // INT4_GROUP, device=W.device) * 0.01).to(self.dtype)
        zeros = torch.full_like(scales, 8.0)
        self.note = f"gemlite {getattr(gemlite, '__version__', '?')} A16W4 group {INT4_GROUP}"
        return A16W4_HQQ_INT(device=str(W.device), dtype=self.dtype).from_weights(W_q=wq, scales=scales, zeros=zeros)

    def nbytes(self, w):
        return sum(t.numel() * t.element_size() for t in w.buffers()) + sum(
            t.numel() * t.element_size() for t in w.parameters())

    def clone(self, w):
        import copy

        return copy.deepcopy(w)

    def call(self, x, w):
        return w(x)


# ----------------------------------------------------------------------------- timing
class Runner:
    def __init__(self, args, bw: float, l2: int, in_step: bool = False):
        """``in_step``: each call timed just after a kernel that writes its input (``common.time_in_step``), as in
        a decoder step, instead of back to back."""
        self.args, self.bw, self.l2, self.in_step = args, bw, l2, in_step
        self._copy_us: dict[int, float] = {}

    def copy_us(self, nbytes: float) -> float:
        """Per-call time of copying nbytes / 2 (so nbytes move), rotated over buffers > 2x L2 like the GEMMs.

        The faster of two timings, each on its own buffers: mid-size copies (10-30 MB) timed 10-15% apart
        from one allocation to the next."""
        torch = common.torch
        half = max(256, int(nbytes / 2) // 256 * 256)
        key = half >> 16  # one timing per 64 KB of size
        if key not in self._copy_us:
            times = []
            for _ in range(2):
                n = copies_for(2 * half, self.l2)
                bufs = [(torch.empty(half, dtype=torch.uint8, device="cuda").fill_(1),
                         torch.empty(half, dtype=torch.uint8, device="cuda")) for _ in range(n)]
                calls = [(lambda s=s, d=d: d.copy_(s)) for s, d in bufs]
                calls = calls * max(1, -(-self.args.calls // len(calls)))
                times.append(time_graph(calls, replays=self.args.replays)["us"])
                del bufs, calls
                free_memory()
            self._copy_us[key] = min(times)
        return self._copy_us[key]

    def rotation(self, peer: Peer, W):
        """Prepare one weight copy, then enough clones that the set exceeds 2x L2."""
        torch = common.torch
        w0 = peer.prepare(W)
        per = peer.nbytes(w0)
        free, _ = torch.cuda.mem_get_info()
        max_copies = max(2, int(self.args.mem_fraction * free // max(per, 1)))
        n = copies_for(per, self.l2, max_copies=max_copies)
        return [w0] + [peer.clone(w0) for _ in range(n - 1)], per

    def time(self, peer: Peer, ws, x) -> dict:
        n_calls = max(self.args.calls, len(ws))
        calls = [(lambda w=ws[i % len(ws)]: peer.call(x, w)) for i in range(n_calls)]
        r = (common.time_in_step(calls, x, replays=self.args.replays) if self.in_step
             else time_graph(calls, replays=self.args.replays))
        r["copies"] = len(ws)
        return r


def try_time(runner: Runner, peer: Peer, ws, x, errors: list, label: str):
    try:
        return runner.time(peer, ws, x)["us"]
    except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
        errors.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None


def accuracy_ratio(qw, dtype, k_in: int, m: int = 16) -> dict:
    """max|kbit - ref32| / max|F.linear(dequant) - ref32| at one M (the tests require <= 2)."""
    torch = common.torch
    import kbit

    x = torch.randn(m, k_in, device="cuda", dtype=torch.float32).to(dtype)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        out = kbit.matmul(x, qw).float()
        ref32 = x.float() @ kbit.dequantize(qw, torch.float32).T
        ref_lp = torch.nn.functional.linear(x, kbit.dequantize(qw, dtype)).float()
    finally:
        torch.set_float32_matmul_precision(old)
    e, e_lp = float((out - ref32).abs().max()), float((ref_lp - ref32).abs().max())
    return {"err_ratio": e / max(e_lp, 1e-30), "finite": bool(torch.isfinite(out).all())}


def planned_path(n_out: int, k_in: int, m: int, k: int) -> str:
    """The path ``kbit.matmul`` takes for the call on this GPU: "fused" or "dequantize_cublas"."""
    import kbit
    from kbit.weight import padded_in_features

    dequantizes = kbit.planner.dequantizes_first(common.torch.device("cuda"), n_out, padded_in_features(k_in), m, k)
    return "dequantize_cublas" if dequantizes else "fused"


def bench_shape(runner: Runner, k_in: int, n_out: int, dtype, log) -> tuple[list, list, list]:
    torch = common.torch
    args = runner.args
    errors: list[str] = []
    name = shape_name(k_in, n_out)
    gen = torch.Generator(device="cuda").manual_seed(k_in * 100003 + n_out)
    W = (torch.randn(n_out, k_in, device="cuda", generator=gen) * 0.02).to(dtype)
    xs = {m: torch.randn(m, k_in, device="cuda", generator=gen).to(dtype) for m in args.m_list}

    # cuBLAS in the same dtype
    cub = Cublas(dtype)
    ws, _ = runner.rotation(cub, W)
    cublas = {m: try_time(runner, cub, ws, xs[m], errors, f"{name} cuBLAS M={m}") for m in args.m_list}
    del ws
    free_memory()

    peer_us: dict[str, dict[int, float]] = {}
    peer_notes: dict[str, str] = {}
    for pname, cls in (("int4", TorchInt4), ("bnb", BnbNF4), ("gemlite", Gemlite)):
        if pname not in args.peer_list:
            continue
        peer = cls(dtype)
        try:
            ws, _ = runner.rotation(peer, W)
            if isinstance(peer, TorchInt4):
                peer._probe_w = ws[0]
                peer.choose_dtype(xs[args.m_list[0]])
        except Exception as e:  # noqa: BLE001
            peer_notes[pname] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
            continue
        peer_us[pname] = {m: try_time(runner, peer, ws, xs[m].to(peer.x_dtype), errors, f"{name} {pname} M={m}")
                          for m in args.m_list}
        peer_notes[pname] = peer.note
        del ws, peer
        free_memory()

    rows = []
    for k in args.k_list:
        t0 = time.time()
        kb = KbitFused(dtype, k)
        kb_us, acc = {}, {}
        try:
            ws, per = runner.rotation(kb, W)
            if not args.no_check:
                acc = accuracy_ratio(kb.qw, dtype, k_in)
            kb_us = {m: try_time(runner, kb, ws, xs[m], errors, f"{name} kbit K={k} M={m}") for m in args.m_list}
            del ws
        except Exception as e:  # noqa: BLE001
            errors.append(f"{name} kbit K={k}: {type(e).__name__}: {e}")
            traceback.print_exc()
        free_memory()
        deq_us = {}
        if "dequant" in args.peer_list and (not args.quick or k == 4):
            dq = DequantCublas(dtype, k)
            try:
                ws, _ = runner.rotation(dq, W)
                deq_us = {m: try_time(runner, dq, ws, xs[m], errors, f"{name} dequant+cuBLAS K={k} M={m}")
                          for m in args.m_list}
                del ws
            except Exception as e:  # noqa: BLE001
                errors.append(f"{name} dequant+cuBLAS K={k}: {type(e).__name__}: {e}")
            del dq
            free_memory()
        wbytes = kbit_weight_bytes(n_out, k_in, k)
        for m in args.m_list:
            path = planned_path(n_out, k_in, m, k)
            planned_us = deq_us.get(m) if path == "dequantize_cublas" else kb_us.get(m)
            nbytes = gemm_bytes(m, k_in, n_out, wbytes)
            fl = floor_us(nbytes, runner.bw)
            copy_us = runner.copy_us(nbytes)
            fl16 = floor_us(gemm_bytes(m, k_in, n_out, n_out * k_in * 2), runner.bw)
            us = kb_us.get(m)
            rows.append({
                "shape": name, "k_in": k_in, "n_out": n_out, "dtype": dtype_name(dtype), "M": m, "K": k,
                "kbit_us": us, "floor_us": fl, "roofline_pct": (100 * fl / us) if us else None,
                "copy_us": copy_us, "copy_roofline_pct": 100 * fl / copy_us,
                "cublas_us": cublas.get(m), "speedup": (cublas[m] / us) if us and cublas.get(m) else None,
                "cublas_roofline_pct": (100 * fl16 / cublas[m]) if cublas.get(m) else None,
                "floor_speedup": (cublas[m] / fl) if cublas.get(m) else None,
                "dequant_cublas_us": deq_us.get(m), "planned_path": path, "planned_us": planned_us,
                **{f"{p}_us": peer_us.get(p, {}).get(m) for p in ("int4", "bnb", "gemlite")},
                "err_ratio": acc.get("err_ratio"), "finite": acc.get("finite"),
            })
        parts = []
        for m in args.m_list:
            sp = cublas[m] / kb_us[m] if kb_us.get(m) and cublas.get(m) else None
            parts.append(f"M={m}: {fmt_us(kb_us.get(m))}us ({fmt_ratio(sp)})")
        acc_txt = f"  err_ratio={acc['err_ratio']:.2f}" if acc else ""
        log(f"  {name} {dtype_name(dtype)} K={k}: " + "  ".join(parts) + acc_txt + f"  [{time.time() - t0:.1f}s]")
    del W, xs
    free_memory()
    meta = [{"shape": name, "dtype": dtype_name(dtype), "peer": p, "note": n} for p, n in peer_notes.items()]
    return rows, errors, meta


# ----------------------------------------------------------------------------- reporting
def add_limits(rows: list) -> None:
    """Sets each row's ``limit_us``, the time no kernel that reads the call's bytes and does its FLOPs at the best
    dense rate seen on the shape can beat: max(floor, FLOPs at cuBLAS's own rate on that shape and dtype at
    ``LIMIT_M`` tokens), and ``limit_pct`` = limit / kbit's time. Where the run has no cuBLAS time at ``LIMIT_M``
    for the shape (a decode sweep), the floor alone, which bounds those token counts anyway."""
    def flops(r):
        return 2 * r["M"] * r["k_in"] * r["n_out"]

    rate = {(r["shape"], r["dtype"]): flops(r) / r["cublas_us"] for r in rows if r["M"] == LIMIT_M and r["cublas_us"]}
    for r in rows:
        dense = rate.get((r["shape"], r["dtype"]))
        r["limit_us"] = max(r["floor_us"], flops(r) / dense if dense else 0.0)
        r["limit_pct"] = 100 * r["limit_us"] / r["kbit_us"] if r["kbit_us"] else None


def _has_dense_rates(rows: list) -> bool:
    """Whether the run timed cuBLAS at ``LIMIT_M`` tokens: otherwise the limit is the floor, tabled already."""
    return any(r["M"] == LIMIT_M and r["cublas_us"] for r in rows)


def _pivot(rows: list, ms) -> list:
    """(dtype, shape, M, {K: row}) in the rows' order, for the token counts ``ms`` (None: all)."""
    keys = []
    for r in rows:
        key = (r["dtype"], r["shape"], r["M"])
        if key not in keys and (ms is None or r["M"] in ms):
            keys.append(key)
    return [(dt, shape, m, {r["K"]: r for r in rows if (r["dtype"], r["shape"], r["M"]) == (dt, shape, m)})
            for dt, shape, m in keys]


def summary_rows(rows: list, ms=SUMMARY_M) -> tuple[list, list]:
    """Pivot: one row per (dtype, shape, M), columns 'K=k: speedup (roofline %)', plus torch int4."""
    ks = sorted({r["K"] for r in rows})
    headers = ["shape", "dtype", "M", "cuBLAS us"] + [f"K={k}" for k in ks] + ["torch int4"]
    out = []
    for dt, shape, m, sel in _pivot(rows, ms):
        any_r = next(iter(sel.values()))
        cells = [shape, dt, m, fmt_us(any_r["cublas_us"])]
        for k in ks:
            r = sel.get(k)
            cells.append(f"{fmt_ratio(r['speedup'])} ({fmt_pct(r['roofline_pct'])})" if r else "-")
        i4 = any_r.get("int4_us")
        cells.append(fmt_ratio(any_r["cublas_us"] / i4) if i4 and any_r["cublas_us"] else "n/a")
        out.append(cells)
    return headers, out


def limit_rows(rows: list, ms=SUMMARY_M) -> tuple[list, list]:
    """Pivot: one row per (dtype, shape, M), columns 'K=k: % of the limit' (``add_limits``)."""
    ks = sorted({r["K"] for r in rows})
    headers = ["shape", "dtype", "M", "limit us (K=4)"] + [f"K={k}" for k in ks]
    out = []
    for dt, shape, m, sel in _pivot(rows, ms):
        four = sel.get(4)
        out.append([shape, dt, m, fmt_us(four["limit_us"]) if four else "-"] +
                   [fmt_pct(sel[k]["limit_pct"]) if k in sel else "-" for k in ks])
    return headers, out


# The token ranges a geomean is taken over: decode (up to 16 tokens) and prefill apart.
GEOMEAN_M = (("M=1", lambda m: m == 1), ("M<=16", lambda m: m <= 16), ("M>=32", lambda m: m >= 32))


def geomean_lines(rows: list) -> list[str]:
    lines = []
    for dt in sorted({r["dtype"] for r in rows}):
        for label, in_range in GEOMEAN_M:
            parts = []
            for k in sorted({r["K"] for r in rows}):
                sel = [r for r in rows if r["dtype"] == dt and r["K"] == k and in_range(r["M"])]
                g = geomean(r["speedup"] for r in sel)
                gp = geomean(r["roofline_pct"] for r in sel)
                if sel:
                    parts.append(f"K={k} {fmt_ratio(g)} ({fmt_pct(gp)})")
            if parts:
                lines.append(f"geomean speedup over cuBLAS {dt}, {label}: " + ", ".join(parts))
    return lines


def full_table(rows: list) -> str:
    headers = ["shape", "dtype", "M", "K", "kbit us", "floor us", "% roofline", "copy us", "copy % roofline",
               "cuBLAS us", "speedup",
               "cuBLAS % roofline", "deq+cuBLAS us", "planned us", "torch int4 us", "bnb NF4 us", "gemlite us",
               "err ratio"]
    body = []
    for r in rows:
        body.append([r["shape"], r["dtype"], r["M"], r["K"], fmt_us(r["kbit_us"]), fmt_us(r["floor_us"]),
                     fmt_pct(r["roofline_pct"]), fmt_us(r.get("copy_us")), fmt_pct(r.get("copy_roofline_pct")),
                     fmt_us(r["cublas_us"]), fmt_ratio(r["speedup"]),
                     fmt_pct(r["cublas_roofline_pct"]), fmt_us(r["dequant_cublas_us"]), fmt_us(r.get("planned_us")),
                     fmt_us(r["int4_us"]), fmt_us(r["bnb_us"]), fmt_us(r["gemlite_us"]),
                     "n/a" if r["err_ratio"] is None else f"{r['err_ratio']:.2f}"])
    return markdown_table(headers, body, align="llrr" + "r" * (len(headers) - 4))


def runs_table(runs: list) -> str:
    """One line per run: its provenance and what it measured."""
    headers = ["run", "date", "kbit commit", "torch (CUDA)", "copy TB/s", "calls / replays", "M", "K", "dtypes",
               "shapes", "peers"]
    body = []
    for i, run in enumerate(runs):
        env, args = run["env"], run["args"]
        body.append([i, env["date"], env["commit"], f"{env['torch']} ({env['torch_cuda']})",
                     f"{run['copy_bandwidth'] / 1e12:.2f}", f"{args['calls']} / {args['replays']}",
                     ", ".join(map(str, args.get("m", []))), ", ".join(map(str, args.get("k", []))),
                     ", ".join(args.get("dtypes", [])), len(args.get("shapes", [])),
                     ", ".join(args.get("peers", [])) or "none"])
    return markdown_table(headers, body, align="rlllrrlllrl")


def render_markdown(data: dict) -> str:
    runs, rows = data["runs"], data["rows"]
    env = runs[0]["env"]
    lines = [
        f"# kbit GEMM benchmark: {env.get('device', '?')}",
        "",
        f"sm {env.get('sm', '?')}, {env.get('num_sms', '?')} SMs, L2 {env.get('l2_bytes', 0) / 2**20:.0f} MiB. "
        "Measured in these runs (each row names its run in the JSON; copy = the run's measured copy bandwidth, "
        "bytes read + written):",
        "",
        runs_table(runs),
        "",
        "CUDA graphs of the run's calls over weight copies totalling > 2x L2, median of its replays. Floor = (k-bit "
        "weight bytes incl. E4M4 absmax + x + y) / the run's copy bandwidth; % roofline = floor / time. copy = a "
        "device-to-device copy moving the same bytes (half read, half written), timed the same way. Speedup = "
        "cuBLAS `F.linear` (same dtype, rotated weights) / kbit. err ratio = max|kbit - fp32 ref| / "
        "max|F.linear(dequant) - fp32 ref| at M=16 (tests require <= 2).",
        "",
        "## Speedup over cuBLAS (in parentheses: % of roofline)",
        "",
    ]
    h, b = summary_rows(rows, ms=None)
    lines += [markdown_table(h, b), ""]
    lines += [f"- {s}" for s in geomean_lines(rows)] + [""]
    if _has_dense_rates(rows):
        lines += ["## Share of the limit", "",
                  f"Limit of a call = max(floor, its FLOPs at cuBLAS's own rate on that shape and dtype at {LIMIT_M} "
                  "tokens), the time no kernel reading these bytes and doing these FLOPs at the best dense rate seen "
                  f"on the shape can beat (the floor alone where the run has no {LIMIT_M}-token cuBLAS time); "
                  "share = limit / kbit's time.", ""]
        h, b = limit_rows(rows, ms=None)
        lines += [markdown_table(h, b), ""]
    if data.get("peer_notes"):
        lines += ["## Peers", ""]
        lines += [f"- {m['shape']} {m['dtype']} {m['peer']}: {m['note']}" for m in data["peer_notes"]]
        lines += [""]
    lines += ["## All measurements (µs)", "", full_table(rows), ""]
    if data.get("errors"):
        lines += ["## Errors", ""] + [f"- `{e}`" for e in data["errors"]] + [""]
    return "\n".join(lines)


def render_summary(data: dict) -> str:
    rows = data["rows"]
    h, b = summary_rows(rows)
    copies = " / ".join(f"{run['copy_bandwidth'] / 1e12:.2f}" for run in data["runs"])
    lines = [f"kbit GEMM on {data['runs'][0]['env'].get('device', '?')} (copy {copies} TB/s): "
             "speedup over cuBLAS (% of roofline)", text_table(h, b)]
    lines += geomean_lines(rows)
    if _has_dense_rates(rows):
        h, b = limit_rows(rows)
        lines += [f"% of the limit (max(floor, FLOPs at cuBLAS's rate at {LIMIT_M} tokens))", text_table(h, b)]
    bad = [r for r in rows if r["err_ratio"] is not None and (r["err_ratio"] > 2 or not r["finite"])]
    if bad:
        lines.append("ACCURACY WARNING: err ratio > 2 or non-finite output for " + ", ".join(
            sorted({f"{r['shape']} {r['dtype']} K={r['K']}" for r in bad})))
    if data.get("errors"):
        lines.append(f"{len(data['errors'])} measurement(s) failed; see the markdown's Errors section")
    return "\n".join(lines)


# A run's provenance: what a results JSON holds per run.
RUN_KEYS = ("env", "copy_bandwidth", "l2_bytes", "args", "elapsed_s")


def results_stem(device: str) -> str:
    return f"gemm_{common.device_tag(device)}"


def load_results(path: Path) -> dict:
    """A results JSON with ``runs`` and rows naming their run; a file written before runs were listed holds its one
    run's provenance at the top level."""
    data = json.loads(path.read_text())
    if "runs" in data:
        return data
    return {"runs": [{key: data[key] for key in RUN_KEYS if key in data}],
            "rows": [dict(r, run=0) for r in data["rows"]],
            "errors": data.get("errors", []), "peer_notes": data.get("peer_notes", [])}


def merge_results(parts: list) -> dict:
    """One result from ``parts``, (name, results) pairs of one device: all runs, their rows renumbered to name
    their run and ordered by dtype, shape, K, M (a sweep's own order). Raises ValueError for runs of different
    devices or a cell (shape, dtype, M, K) in two parts."""
    devices = {name: {run["env"].get("device") for run in data["runs"]} for name, data in parts}
    if len(set().union(*devices.values())) != 1:
        raise ValueError("--render: runs of different devices cannot be merged: " + ", ".join(
            f"{name} ({', '.join(sorted(map(str, found)))})" for name, found in devices.items()))
    merged = {"runs": [], "rows": [], "errors": [], "peer_notes": []}
    measured_in = {}
    for name, data in parts:
        first_run = len(merged["runs"])
        for r in data["rows"]:
            cell = (r["shape"], r["dtype"], r["M"], r["K"])
            if cell in measured_in:
                raise ValueError(f"--render: {r['shape']} {r['dtype']} M={r['M']} K={r['K']} is measured in both "
                                 f"{measured_in[cell]} and {name}; leave one of them out")
            measured_in[cell] = name
            merged["rows"].append(dict(r, run=r["run"] + first_run))
        merged["runs"] += data["runs"]
        merged["errors"] += data["errors"]
        merged["peer_notes"] += data["peer_notes"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in merged["rows"]))
    shapes = list(dict.fromkeys(r["shape"] for r in merged["rows"]))
    merged["rows"].sort(key=lambda r: (dtypes.index(r["dtype"]), shapes.index(r["shape"]), r["K"], r["M"]))
    return merged


def render_saved(paths: list, out_dir) -> int:
    """``--render``: the markdown (and the JSON, with the derived fields) of saved results, written again: one file in
    place, several merged into the device's set (``merge_results``)."""
    try:
        data = merge_results([(str(p), load_results(p)) for p in paths])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    add_limits(data["rows"])
    stem = paths[0].stem if len(paths) == 1 else results_stem(data["runs"][0]["env"]["device"])
    write_outputs(Path(out_dir) if out_dir else paths[0].parent, stem, render_markdown(data), data)
    print(render_summary(data))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render_saved([Path(p) for p in args.render], args.out)
    common.require_cuda("bench_gemm.py")
    torch = common.torch
    import kbit  # noqa: F401

    t_start = time.time()
    out_dir = Path(args.out) if args.out else common.out_dir_default()
    env = env_info()

    def log(msg):
        print(msg, flush=True)

    log(f"device: {env['device']} (sm {env['sm']}, {env['num_sms']} SMs, L2 {env['l2_bytes'] / 2**20:.0f} MiB), "
        f"torch {env['torch']}, kbit {env['commit']}")
    # Build / load the extension before any timing.
    t0 = time.time()
    kbit.matmul(torch.zeros(1, 64, device="cuda", dtype=torch.float16),
                kbit.quantize(torch.randn(128, 64, device="cuda", dtype=torch.float16), 4))
    torch.cuda.synchronize()
    log(f"kbit extension ready in {time.time() - t0:.1f}s")
    bw = copy_bandwidth()
    l2 = l2_bytes()
    log(f"copy bandwidth: {bw / 1e12:.3f} TB/s (read + write)")
    runner = Runner(args, bw, l2)
    rows, errors, notes = [], [], []
    for dtype in args.dtype_list:
        for k_in, n_out in args.shape_list:
            r, e, n = bench_shape(runner, k_in, n_out, dtype, log)
            rows += r
            errors += e
            notes += n
            for msg in e:
                log(f"  error: {msg}")
    add_limits(rows)
    run = {
        "env": env, "copy_bandwidth": bw, "l2_bytes": l2,
        "args": {"shapes": [shape_name(*s) for s in args.shape_list], "m": args.m_list, "k": args.k_list,
                 "dtypes": [dtype_name(d) for d in args.dtype_list], "quick": args.quick, "calls": args.calls,
                 "replays": args.replays, "peers": args.peer_list},
        "elapsed_s": round(time.time() - t_start, 1),
    }
    data = {"runs": [run], "rows": [dict(r, run=0) for r in rows], "errors": errors, "peer_notes": notes}
    stem = results_stem(env["device"]) + (f"_{args.tag}" if args.tag else "_quick" if args.quick else "")
    md_path, js_path = write_outputs(out_dir, stem, render_markdown(data), data)
    written = [md_path, js_path]
    if not args.no_plot:
        try:
            import plot

            png = plot.plot_gemm(data, out_dir / f"{stem}.png")
            if png:
                written.append(png)
            else:
                log("note: matplotlib is not installed; PNG skipped (run benchmarks/plot.py on the JSON elsewhere)")
        except Exception as e:  # noqa: BLE001
            log(f"note: PNG failed: {type(e).__name__}: {e}")
    summary = render_summary(data)
    (out_dir / f"{stem}_summary.txt").write_text(summary + "\n")
    log("wrote " + ", ".join(str(p) for p in written) + f" in {time.time() - t_start:.0f}s")
    log("")
    log(summary)
    kbit_failed = any(r["kbit_us"] is None for r in rows) or any(
        r["err_ratio"] is not None and (r["err_ratio"] > 2 or not r["finite"]) for r in rows)
    return 1 if kbit_failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
