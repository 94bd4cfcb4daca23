"""Tile parts summed in thread-block clusters (kbit/csrc/gemm.cuh, GemmConfig::kClustered) against the planned
launch, up to 16 tokens (compute capability 9.x).

    python benchmarks/bench_cluster_split.py                       # K=4 fp16, M = 1 and 16, six shapes (< 60 s)
    python benchmarks/bench_cluster_split.py --shapes 4096->1024 --m 1
    python benchmarks/bench_cluster_split.py --grids 64,96,112,120,128,132      # and those grids, no parts
    python benchmarks/bench_cluster_split.py --in-step     # each call after a kernel writing its input, as in a step

Per shape and M: the planned launch (``kbit.ops.gemm``: the planner's configuration and grid), then for every mma.sync
configuration up to 16 tokens (mb 1 and 2, k split 1 and 8) and every cluster size C in 2..8 that fits (C <= a tile's
k-steps, tiles x C <= SMs), the same weights with each tile's k-steps in C parts on one cluster of C CTAs (tile_parts =
C on tiles x C CTAs), and, where C divides the k-steps, the same parts on the same grid cut in one group, whose split
tiles meet through L2 (the two columns differ only in the hand-off; bitwise the same sums). With ``--grids``, each of
those configurations' steps also in one group on each grid given (at most a CTA per step) and, for the k split, on a CTA
per tile: the launches the planner chooses among (C = 0 in the tables). Timed as bench_gemm.py times
(docs/PERFORMANCE.md#method): CUDA graphs of calls over weight copies that together exceed twice L2, the median replay
over the calls; the copy of the call's bytes timed the same way. Clusters the GPU cannot hold all at once run in waves
(the time shows it). ``--in-step`` times each call just after an elementwise kernel that writes its input, less that
kernel (``common.time_in_step``): in a decoder step a projection follows a norm, an activation or attention, none of
which lets it start early, where back to back each call starts under the last one's tail. Prints every launch, then the
best per shape and M last; writes bench_cluster_split.json to $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/common.py; puts the repo root on sys.path)
from bench_gemm import KbitFused, Runner  # noqa: E402
from common import (  # noqa: E402
    env_info, fmt_ratio, fmt_us, gemm_bytes, kbit_weight_bytes, l2_bytes, parse_dtypes, parse_int_list, parse_shape,
    shape_name, text_table,
)

DEFAULT_SHAPES = ["4096->1024", "4096->4096", "4096->6144", "2048->1536", "14336->4096", "4096->28672"]
DEFAULT_M = [1, 16]
CLUSTER_SIZES = tuple(range(2, 9))  # the binding's: 2 to 8 parts, a portable cluster
# A forced launch's output against the planned one's (relative Frobenius norm): both sum the same products in another
# order, so they agree to a few output roundings.
AGREEMENT = 1e-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma-separated K_in->N_out list")
    p.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="comma-separated token counts, 1 to 16")
    p.add_argument("--clusters", default=",".join(map(str, CLUSTER_SIZES)), help="cluster sizes to try, 2 to 8")
    p.add_argument("--grids", default="", help="comma-separated grids to try with the steps in one group (default none)")
    p.add_argument("--k", type=int, default=4, choices=(2, 3, 4, 5), help="bits per weight (default 4)")
    p.add_argument("--dtype", default="fp16", help="activation dtype: fp16 or bf16 (default fp16)")
    p.add_argument("--calls", type=int, default=20, help="minimum calls per CUDA graph (default 20)")
    p.add_argument("--replays", type=int, default=7, help="graph replays; the median is reported (default 7)")
    p.add_argument("--mem-fraction", type=float, default=0.5,
                   help="cap on the free GPU memory one rotation set may use (default 0.5)")
    p.add_argument("--in-step", action="store_true",
                   help="time each call just after a kernel that writes its input, as a projection runs in a decoder "
                        "step (back to back, each call starts under the last one's tail)")
    args = p.parse_args(argv)
    try:
        args.shape_list = [parse_shape(s) for s in args.shapes.split(",")]
        args.m_list = parse_int_list(args.m, "--m", allowed=range(1, 17))
        args.cluster_list = parse_int_list(args.clusters, "--clusters", allowed=CLUSTER_SIZES)
        args.grid_list = parse_int_list(args.grids, "--grids", allowed=range(1, 1025)) if args.grids else []
        (args.dtype_t,) = parse_dtypes(args.dtype)
    except ValueError as e:
        p.error(str(e))
    if args.dtype_t not in (common.torch.float16, common.torch.bfloat16):
        p.error("--dtype: the GEMM takes fp16 or bf16 activations")
    return args


class ForcedLaunch(KbitFused):
    """The weights of ``fused`` on a forced configuration and launch: the extension's GEMM with its launch arguments
    (grid, tile_parts), as the tests force them."""

    def __init__(self, fused: KbitFused, config, grid: int, parts: int):
        super().__init__(fused.dtype, fused.k)
        self.qw, self.kdim = fused.qw, fused.kdim
        self.config, self.grid, self.parts = config, grid, parts

    def call(self, x, w):
        from kbit import ops
        from kbit._build import cuda_ext

        qw, c = self.qw, self.config
        return cuda_ext().gemm(x, w[0], w[1], qw.codebook, qw.scale, None, qw.bits, qw.shape[0], self.kdim, self.grid,
                               self.parts, False, c.mb, c.wgmma_tiles, c.k_split, c.ws_tokens,
                               ops.weights_settled(w[0], w[1], qw.codebook))


def config_name(c) -> str:
    if c.ws_tokens:
        return f"ws{c.ws_tokens}"
    return f"mb{c.mb}" + (f" wg{c.wgmma_tiles}" if c.wgmma_tiles else "") + (f" ks{c.k_split}" if c.k_split > 1 else "")


def cluster_launches(facts, k: int, n_out: int, kdim: int, m: int, sizes) -> list:
    """(config, tiles, k-steps, C) of every clustered launch of the cluster sizes `sizes` that fits the device."""
    from kbit import planner

    found = []
    for c in facts.configs:
        if c.bits != k or not c.tile_parts_in_clusters or not c.runs_on(facts.device):
            continue
        steps = planner.steps_of(c, planner.Shape(n_out, kdim, m, k))
        found += [(c, steps.tiles, steps.k_steps, C) for C in sizes
                  if C <= steps.k_steps and steps.tiles * C <= facts.device.sms]
    return found


def group_launches(facts, k: int, n_out: int, kdim: int, m: int, grids) -> list:
    """(config, tiles, k-steps, grid) of the clustered launches' configurations with their steps in one group on each
    of ``grids`` that the device and the steps allow (a CTA per SM and per step at most), and for the k split on a CTA
    per tile: the launches ``kbit.planner.launches`` offers, and others."""
    from kbit import planner

    found = []
    for c in facts.configs:
        if c.bits != k or not c.tile_parts_in_clusters or not c.runs_on(facts.device):
            continue
        steps = planner.steps_of(c, planner.Shape(n_out, kdim, m, k))
        per_tile = [steps.tiles] if c.k_split > 1 and steps.tiles <= facts.device.sms else []
        found += [(c, steps.tiles, steps.k_steps, g) for g in sorted(set(grids) | set(per_tile))
                  if g <= min(facts.device.sms, steps.total)]
    return found


def bench_shape(runner: Runner, facts, args, k_in: int, n_out: int, log) -> list:
    torch = common.torch
    from kbit import planner

    fused = KbitFused(args.dtype_t, args.k)
    W = torch.randn(n_out, k_in, device="cuda", dtype=torch.float32).mul_(0.02).to(args.dtype_t)
    ws, _ = runner.rotation(fused, W)
    del W
    weight_bytes = kbit_weight_bytes(n_out, k_in, args.k)
    rows = []
    for m in args.m_list:
        x = torch.randn(m, k_in, device="cuda", dtype=args.dtype_t)
        plan = planner.gemm_plan(x.device, n_out, fused.kdim, m, args.k, fused_only=True)
        planned = runner.time(fused, ws, x)["us"]
        copy = runner.copy_us(gemm_bytes(m, k_in, n_out, weight_bytes))
        reference = fused.call(x, ws[0]).float()
        base = {"shape": shape_name(k_in, n_out), "m": m, "planned_us": planned, "copy_us": copy,
                "planned": {"config": config_name(plan), "grid": plan.grid, "tile_parts": plan.tile_parts}}
        log(f"{base['shape']} M={m}: planned {base['planned']['config']} grid {plan.grid} {planned:.2f} us, "
            f"copy {copy:.2f} us")
        for config, tiles, k_steps, C in cluster_launches(facts, args.k, n_out, fused.kdim, m, args.cluster_list):
            row = dict(base, config=config_name(config), tiles=tiles, k_steps=k_steps, cluster=C, grid=tiles * C)
            times = {"cluster_us": None, "l2_us": None}
            for name, parts in (("cluster_us", C), ("l2_us", 0))[:2 if k_steps % C == 0 else 1]:
                peer = ForcedLaunch(fused, config, tiles * C, parts)
                try:
                    y = peer.call(x, ws[0]).float()
                except RuntimeError as e:  # refused by the binding (this GPU): reported, not fatal
                    log(f"  {row['config']} C={C} tile_parts={parts}: {e}")
                    continue
                error = float((y - reference).norm() / reference.norm().clamp_min(1e-30))
                times[name] = runner.time(peer, ws, x)["us"] if error <= AGREEMENT else None
                if times[name] is None:
                    log(f"  {row['config']} C={C} tile_parts={parts}: output differs from the planned launch's by "
                        f"{error:.2g}; not timed")
            row.update(times)
            row["speedup"] = planned / row["cluster_us"] if row["cluster_us"] else None
            log(f"  {row['config']:>8} C={C} grid {row['grid']:>3}: cluster {fmt_us(row['cluster_us'])} us, same cut "
                f"through L2 {fmt_us(row['l2_us'])} us")
            rows.append(row)
        for config, tiles, k_steps, grid in group_launches(facts, args.k, n_out, fused.kdim, m, args.grid_list):
            row = dict(base, config=config_name(config), tiles=tiles, k_steps=k_steps, cluster=0, grid=grid,
                       cluster_us=None, l2_us=None, speedup=None)
            peer = ForcedLaunch(fused, config, grid, 0)
            try:
                error = float((peer.call(x, ws[0]).float() - reference).norm() / reference.norm().clamp_min(1e-30))
            except RuntimeError as e:  # refused by the binding (this GPU): reported, not fatal
                log(f"  {row['config']} grid {grid}: {e}")
                continue
            if error <= AGREEMENT:
                row["l2_us"] = runner.time(peer, ws, x)["us"]
                row["speedup"] = planned / row["l2_us"]
            log(f"  {row['config']:>8} one group, grid {grid:>3}: {fmt_us(row['l2_us'])} us")
            rows.append(row)
        if not any(r["m"] == m and r["shape"] == base["shape"] for r in rows):
            rows.append(dict(base, config=None, cluster=None, grid=None, cluster_us=None, l2_us=None, speedup=None))
    del ws
    common.free_memory()
    return rows


def launch_us(row: dict) -> float:
    """A row's time: its clustered launch's, or with C = 0 (``--grids``) its steps in one group."""
    us = row["l2_us"] if row.get("cluster") == 0 else row["cluster_us"]
    return us or float("inf")


def best_rows(rows: list) -> list:
    """Per shape and M, the fastest launch timed (or none)."""
    best = {}
    for r in rows:
        key = (r["shape"], r["m"])
        if key not in best or launch_us(r) < launch_us(best[key]):
            best[key] = r
    return list(best.values())


def render(rows: list, heading: str) -> str:
    """Every launch timed, then the best per shape and M against the planned launch (printed last). C = 0: the steps
    in one group on that grid (``--grids``), its time in the L2 column."""
    every = [[r["shape"], r["m"], r["planned"]["config"], r["planned"]["grid"], fmt_us(r["planned_us"]), r["config"],
              r["cluster"], r["grid"], fmt_us(r["cluster_us"]), fmt_us(r["l2_us"]), fmt_ratio(r["speedup"])]
             for r in rows if r["config"] is not None]
    best = [[r["shape"], r["m"], fmt_us(r["copy_us"]), f"{r['planned']['config']} / {r['planned']['grid']}",
             fmt_us(r["planned_us"]),
             f"{r['config']} C={r['cluster']} / {r['grid']}" if r["config"] is not None else "none fits",
             fmt_us(r["cluster_us"]), fmt_us(r["l2_us"]), fmt_ratio(r["speedup"])] for r in best_rows(rows)]
    return "\n".join([
        text_table(["shape", "M", "planned", "grid", "us", "config", "C", "grid", "cluster us", "L2 us (same cut)",
                    "speedup"], every),
        "",
        f"{heading} Best launch per shape and M (speedup over the planned launch):",
        text_table(["shape", "M", "copy us", "planned / grid", "planned us", "launch / grid", "cluster us",
                    "L2 us (same cut)", "speedup"], best)])


def main(argv=None) -> int:
    args = parse_args(argv)
    torch = common.torch
    common.require_cuda("bench_cluster_split")
    from kbit import planner

    facts = planner.device_facts(torch.device("cuda"))
    if facts.device.capability[0] < 9:
        print("bench_cluster_split: thread-block clusters need compute capability 9.0", file=sys.stderr)
        return 1
    start = time.perf_counter()
    runner = Runner(argparse.Namespace(calls=args.calls, replays=args.replays, mem_fraction=args.mem_fraction), 0.0,
                    l2_bytes(), in_step=args.in_step)
    rows = []
    for k_in, n_out in args.shape_list:
        rows += bench_shape(runner, facts, args, k_in, n_out, lambda s: print(s, flush=True))
    seconds = time.perf_counter() - start

    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "bench_cluster_split.json"
        path.write_text(json.dumps({"env": env_info(), "k": args.k, "dtype": args.dtype, "in_step": args.in_step,
                                    "seconds": seconds, "rows": rows}, indent=1))
        print(f"wrote {path}")
    print()
    timing = "each call after a kernel writing its input" if args.in_step else "calls back to back"
    print(render(rows, f"K={args.k} {args.dtype}, {facts.device.name}, {facts.device.sms} SMs, {timing}; "
                       f"{seconds:.0f} s."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
