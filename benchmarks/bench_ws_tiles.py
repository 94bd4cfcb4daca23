"""The warp-specialized kernel's tile sizes past 64 tokens: 64 against 128 tokens per tile, in one process.

    python benchmarks/bench_ws_tiles.py                               # H100/H200, ~2 min
    python benchmarks/bench_ws_tiles.py --bits 4 --m 128,192 --shapes 4096->4096

Where kbit/dispatch.py's WS_64_TOKEN_TILES_FROM crossovers come from. Both configurations are run explicitly
through the extension (the planner is bypassed), on weight copies rotated past twice the L2 cache, each timed as a
CUDA graph of calls (median of replays, as bench_gemm.py); their outputs are checked against each other. Prints one
line per (bits, shape, M): both times, their ratio and the steps per SM 128-token tiles leave (token passes x
256-row tiles x 256-column k-groups / SMs), a summary last; writes bench_ws_tiles.md and .json under --out.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402

from kbit import ops  # noqa: E402
from kbit._build import cuda_ext  # noqa: E402
from kbit.formats import padded_in_features  # noqa: E402
from kbit.weight import quantize  # noqa: E402

SHAPES = "8192->28672,14336->4096,4096->14336,11008->4096,4096->11008,4096->4096"
TILES = (64, 128)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help=f"K_in->N_out list (default {SHAPES})")
    p.add_argument("--m", default="128,160,192,256,320,512", help="token counts (each > 64)")
    p.add_argument("--bits", default="2,3,4,5")
    p.add_argument("--calls", type=int, default=10, help="calls per CUDA graph, at least (default 10)")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--out", default=".", help="folder of bench_ws_tiles.json (default: here)")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("bench_ws_tiles.py: needs a compute capability 9.x GPU (the warp-specialized kernel)", file=sys.stderr)
        return 2
    shapes = [common.parse_shape(s) for s in args.shapes.split(",")]
    tokens = common.parse_int_list(args.m, "--m")
    if min(tokens) <= 64:
        p.error("--m: 64 tokens and fewer take 32- or 64-token tiles whatever the rule")
    bits_list = common.parse_int_list(args.bits, "--bits", allowed=range(2, 6))
    ext, l2, sms = cuda_ext(), common.l2_bytes(), torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for bits in bits_list:
        for k_in, n_out in shapes:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                qw = quantize(torch.randn(n_out, k_in, device="cuda", dtype=torch.float16) * 0.02, bits)
            kp = padded_in_features(k_in)
            first = tuple(qw.gemm_layout())
            layouts = common.rotated_copies(first, l2)
            for M in tokens:
                x = torch.randn(M, k_in, device="cuda", dtype=torch.float16)

                def run(lay, tile, x=x):
                    return ext.gemm(x, lay[0], lay[1], qw.codebook, qw.scale, None, bits, n_out, kp, 0, tile // 8, 0, 1,
                                    tile, ops.weights_settled(*lay, qw.codebook))

                ys = [run(first, tile).float() for tile in TILES]
                error = float((ys[0] - ys[1]).norm() / ys[1].norm().clamp_min(1e-30))
                if error > 1e-3:
                    raise SystemExit(f"bench_ws_tiles.py: the tiles disagree at bits={bits} {k_in}->{n_out} M={M}: "
                                     f"relative difference {error:.2g}")
                us = {}
                for tile in TILES:
                    us[tile] = common.time_rotated(lambda w, t=tile: run(w, t), layouts, args.calls, args.replays)
                steps = -(-M // 128) * -(-n_out // 256) * -(-kp // 256) / sms
                row = {"bits": bits, "shape": f"{k_in}->{n_out}", "M": M, "us_64": us[64], "us_128": us[128],
                       "ratio": us[64] / us[128], "steps_per_sm_128": steps}
                rows.append(row)
                print(f"bits={bits} {k_in}->{n_out} M={M}: 64 tokens {us[64]:.1f} us, 128 tokens {us[128]:.1f} us, "
                      f"ratio {row['ratio']:.2f}, {steps:.1f} steps per SM at 128", flush=True)
            del layouts, first, qw
            torch.cuda.empty_cache()
    table = common.markdown_table(
        ["bits", "shape", "M", "64 tokens (us)", "128 tokens (us)", "ratio", "steps per SM at 128"],
        [[r["bits"], r["shape"], r["M"], f"{r['us_64']:.1f}", f"{r['us_128']:.1f}", f"{r['ratio']:.2f}",
          f"{r['steps_per_sm_128']:.1f}"] for r in rows])
    common.write_outputs(Path(args.out), "bench_ws_tiles", table + "\n", {"env": common.env_info(), "rows": rows})
    print("summary: 64-token tiles faster (ratio < 0.97) in "
          f"{sum(r['ratio'] < 0.97 for r in rows)} of {len(rows)} cases; slower (> 1.03) in "
          f"{sum(r['ratio'] > 1.03 for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
