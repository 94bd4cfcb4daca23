"""The warp-specialized kernel's tile sizes: two of its tokens per tile (64 against 128 by default; 128 against 256
with --tiles 128,256), in one process, at any token count it runs (17 on; at or below the smaller tile both take one
pass, with different tile shapes).

    python benchmarks/bench_ws_tiles.py                               # H100/H200, ~2 min
    python benchmarks/bench_ws_tiles.py --bits 4 --m 128,192 --shapes 4096->4096
    python benchmarks/bench_ws_tiles.py --tiles 128,256 --m 256,512,1024,4096 --out results
    python benchmarks/bench_ws_tiles.py --tiles 128,256 --bits 4 --m 1024,4096 --per-sm-grid

Where kbit/dispatch.py's WS_64_TOKEN_TILES_FROM and WS_256_TOKEN_TILES_FROM crossovers come from. Both
configurations are run explicitly through the extension (the planner is bypassed), on weight copies rotated past
twice the L2 cache, each timed as a CUDA graph of calls (median of replays, as bench_gemm.py); their outputs are
checked against each other. Prints one line per (bits, shape, M): both times, their ratio (first tile's time over
the second's) and the steps per SM the second leaves (token passes x row tiles x 256-column k-groups / SMs), a
summary last; writes bench_ws_tiles.md and .json under --out. Each configuration runs on the grid the host plans
(gemm.cu and cut.h: whole tiles per CTA where a grid of at least 95% of the SMs divides them, or one apart at 256
tokens); --per-sm-grid times it on one CTA per SM too (tiles split across CTAs).
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
TILES = "64,128"
ROWS = {32: 256, 64: 256, 128: 256, 256: 128}  # weight rows per CTA tile (gemm_ws.cuh, WsConfig::kTileRows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help=f"K_in->N_out list (default {SHAPES})")
    p.add_argument("--m", default="128,160,192,256,320,512", help="token counts (each > 16: the kernel's range)")
    p.add_argument("--bits", default="2,3,4,5")
    p.add_argument("--calls", type=int, default=10, help="calls per CUDA graph, at least (default 10)")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--tiles", default=TILES, help=f"two tokens per tile of 32, 64, 128, 256 (default {TILES})")
    p.add_argument("--per-sm-grid", action="store_true",
                   help="also time each tile width on one CTA per SM (stream-K, split tiles)")
    p.add_argument("--out", default=".", help="folder of bench_ws_tiles.json (default: here)")
    args = p.parse_args()
    tiles = tuple(common.parse_int_list(args.tiles, "--tiles", allowed=ROWS))
    if len(tiles) != 2 or tiles[0] == tiles[1]:
        p.error("--tiles: two different tokens per tile")
    first_tile, second_tile = tiles
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("bench_ws_tiles.py: needs a compute capability 9.x GPU (the warp-specialized kernel)", file=sys.stderr)
        return 2
    shapes = [common.parse_shape(s) for s in args.shapes.split(",")]
    tokens = common.parse_int_list(args.m, "--m")
    if min(tokens) <= 16:
        p.error("--m: the warp-specialized kernel runs from 17 tokens")
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

                def run(lay, tile, grid=0, x=x):  # grid 0: the host's plan
                    return ext.gemm(x, lay[0], lay[1], qw.codebook, qw.scale, None, bits, n_out, kp, grid, tile // 8, 0,
                                    1, tile, ops.weights_settled(*lay, qw.codebook))

                ys = [run(first, tile).float() for tile in tiles]
                error = float((ys[0] - ys[1]).norm() / ys[1].norm().clamp_min(1e-30))
                if error > 1e-3:
                    raise SystemExit(f"bench_ws_tiles.py: the tiles disagree at bits={bits} {k_in}->{n_out} M={M}: "
                                     f"relative difference {error:.2g}")
                us = {}
                for tile in tiles:
                    us[tile] = common.time_rotated(lambda w, t=tile: run(w, t), layouts, args.calls, args.replays)
                steps = -(-M // second_tile) * -(-n_out // ROWS[second_tile]) * -(-kp // 256) / sms
                row = {"bits": bits, "shape": f"{k_in}->{n_out}", "M": M, f"us_{first_tile}": us[first_tile],
                       f"us_{second_tile}": us[second_tile], "ratio": us[first_tile] / us[second_tile],
                       f"steps_per_sm_{second_tile}": steps}
                per_sm = ""
                if args.per_sm_grid:
                    for tile in tiles:
                        row[f"us_{tile}_per_sm"] = common.time_rotated(lambda w, t=tile: run(w, t, sms), layouts,
                                                                       args.calls, args.replays)
                    per_sm = "; one CTA per SM " + ", ".join(f"{row[f'us_{t}_per_sm']:.1f}" for t in tiles) + " us"
                rows.append(row)
                print(f"bits={bits} {k_in}->{n_out} M={M}: {first_tile} tokens {us[first_tile]:.1f} us, "
                      f"{second_tile} tokens {us[second_tile]:.1f} us, ratio {row['ratio']:.2f}, "
                      f"{steps:.1f} steps per SM at {second_tile}{per_sm}", flush=True)
            del layouts, first, qw
            torch.cuda.empty_cache()
    per_sm_heads = [f"{t} tokens, one CTA per SM (us)" for t in tiles] if args.per_sm_grid else []
    table = common.markdown_table(
        ["bits", "shape", "M", f"{first_tile} tokens (us)", f"{second_tile} tokens (us)", "ratio",
         f"steps per SM at {second_tile}"] + per_sm_heads,
        [[r["bits"], r["shape"], r["M"], f"{r[f'us_{first_tile}']:.1f}", f"{r[f'us_{second_tile}']:.1f}",
          f"{r['ratio']:.2f}", f"{r[f'steps_per_sm_{second_tile}']:.1f}"]
         + ([f"{r[f'us_{t}_per_sm']:.1f}" for t in tiles] if args.per_sm_grid else []) for r in rows])
    common.write_outputs(Path(args.out), "bench_ws_tiles", table + "\n", {"env": common.env_info(), "rows": rows})
    print(f"summary: {first_tile}-token tiles faster (ratio < 0.97) in "
          f"{sum(r['ratio'] < 0.97 for r in rows)} of {len(rows)} cases; slower (> 1.03) in "
          f"{sum(r['ratio'] > 1.03 for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
