"""A/B of kbit's two fused GEMM kernels in one process, against cuBLAS fp16 and dequantize + cuBLAS.

    python benchmarks/bench_gemm_paths.py          # H100/H200; prints one line per case, a summary last

gemm.cuh's kernel ("classic") and the warp-specialized gemm_ws.cuh ("ws", compute capability 9.x) are forced in
turn through KBIT_GEMM_PATH, which kbit's planner reads at every call, so both are captured and timed in the same
process as cuBLAS. Same method as bench_gemm.py, lighter: a CUDA graph of 10 calls on weight copies rotated past
2x L2, median of 5 replays. Also prints the relative difference of the two kernels' outputs per case. Writes
bench_ws.json under $OUT (or the current folder). BENCH_ONLY=shape,... restricts the shapes; BENCH_BUDGET_S caps
the time (default 170 s).
"""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

import kbit  # noqa: E402
from kbit.weight import padded_in_features  # noqa: E402

CALLS, REPLAYS = 10, 5
L2 = common.l2_bytes()


def main():
    cases = []  # (shape, k, [M...])
    big = ["8192->28672", "28672->8192", "14336->4096", "4096->14336", "11008->4096", "4096->11008"]
    ms_all = [32, 64, 128, 256, 512, 1024, 2048, 4096]
    for sh in big[:2]:
        cases.append((sh, 4, ms_all))
    for sh in big[2:]:
        cases.append((sh, 4, [32, 64, 128, 256, 512, 1024]))
    for sh in ["4096->4096", "2048->10240", "2048->1536"]:
        cases.append((sh, 4, [32, 64, 128, 256, 1024]))
    for k in (2, 3, 5):
        cases.append(("8192->28672", k, [32, 64, 128, 256, 512, 1024]))
        cases.append(("14336->4096", k, [32, 64, 128, 256]))
    only = os.environ.get("BENCH_ONLY")
    rows, out = [], []
    t0 = time.time()
    budget = float(os.environ.get("BENCH_BUDGET_S", "170"))
    for sh, k, ms in cases:
        if only and sh not in only.split(","):
            continue
        if time.time() - t0 > budget:
            print(f"# time budget reached, skipping {sh} k={k}", flush=True)
            continue
        k_in, n_out = common.parse_shape(sh)
        W = torch.randn(n_out, k_in, device="cuda", dtype=torch.float16)
        qw = kbit.quantize(W, k)
        kp = padded_in_features(k_in)
        lay = qw.gemm_layout()
        kb = common.rotated_copies(tuple(lay), L2)
        fp = common.rotated_copies(W.clone(), L2)
        st = common.rotated_copies((qw.packed, qw.absmax), L2, qw.packed.numel() * 4)
        for M in ms:
            x = torch.randn(M, k_in, device="cuda", dtype=torch.float16)
            res = {"shape": sh, "k": k, "M": M}

            def kb_call(w, x=x):
                return kbit.ops.gemm(x, w[0], w[1], qw.codebook, qw.scale, None, qw.bits, n_out, kp, 0)

            for path in ("classic", "ws"):
                os.environ["KBIT_GEMM_PATH"] = path
                try:
                    res[path] = common.time_rotated(kb_call, kb, CALLS, REPLAYS)
                except Exception as e:  # noqa: BLE001
                    res[path] = None
                    print(f"# {sh} k={k} M={M} {path}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            # agreement of the two paths on this case (the tests cover correctness against references)
            try:
                os.environ["KBIT_GEMM_PATH"] = "classic"
                a = kb_call(kb[0]).float()
                os.environ["KBIT_GEMM_PATH"] = "ws"
                b = kb_call(kb[0]).float()
                res["rel_diff"] = float((a - b).norm() / a.norm().clamp_min(1e-30))
            except Exception as e:  # noqa: BLE001
                res["rel_diff"] = None
                print(f"# {sh} k={k} M={M} compare: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            os.environ.pop("KBIT_GEMM_PATH", None)
            res["cublas"] = common.time_rotated(lambda w, x=x: torch.nn.functional.linear(x, w), fp, CALLS, REPLAYS)
            if M >= 128 and k_in * n_out >= (32 << 20):
                def dq_call(w, x=x):
                    wh = kbit.ops.dequantize(w[0], w[1], qw.codebook, qw.bits, n_out * kp, torch.float16, qw.scale)
                    return torch.nn.functional.linear(x, wh.view(n_out, kp)[:, :k_in])
                res["dequant"] = common.time_rotated(dq_call, st, CALLS, REPLAYS)
            out.append(res)
            c, w_, cb = res["classic"], res["ws"], res["cublas"]
            line = (f"{sh:>12} k={k} M={M:>5}  cuBLAS {cb:8.1f}  classic {c if c is None else round(c, 1)!s:>8} "
                    f"({'-' if c is None else f'{cb / c:.2f}x'})  ws {w_ if w_ is None else round(w_, 1)!s:>8} "
                    f"({'-' if w_ is None else f'{cb / w_:.2f}x'})  dq {res.get('dequant', '-')}  diff {res['rel_diff']:.2g}")
            print(line, flush=True)
            rows.append(line)
        del kb, fp, st, W, qw, lay
        torch.cuda.empty_cache()
    od = os.environ.get("OUT", ".")
    Path(od, "bench_ws.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": out}, indent=1))
    print("\n".join(["== summary (speedup over cuBLAS fp16) =="] + rows))


if __name__ == "__main__":
    main()
