"""Split-K on forced grids: within tolerance and bitwise identical over repeats, on every path, and on
concurrent streams (tests/cuda_harness.py)."""

from __future__ import annotations

import pytest
import torch

import kbit
from cuda_harness import (assert_bits_equal, BITS, _bits, GemmChecker, gen, _name, needs_hopper, quantized_weight,
    run_matmul, seed_for, SPLITK_REPS, tag)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
    pytest.mark.usefixtures("ieee_fp32_matmul"),  # fp32 references are real fp32 products (conftest.py)
]


# ----------------------------------------------------------------------------- forced split-K
SPLITK_SHAPES = ((128, 4096), (1536, 2048), (4096, 14336))  # (N, K): 16, 8 and 56 k-groups
SPLITK_GRIDS = (1, 3, 7, 64, 132, 1000)  # 1000: more than the SMs, clamped to one CTA per SM
SPLITK_CASES = [(k, torch.float16) for k in BITS] + [(4, torch.bfloat16), (3, torch.bfloat16)]


@needs_hopper
@pytest.mark.parametrize("path,ms", (("ws", (17, 100, 200)), ("k_split", (1, 5, 8, 16))), ids=lambda v: str(v))
@pytest.mark.parametrize("k,dtype", [(k, torch.float16) for k in BITS] + [(4, torch.bfloat16)], ids=lambda v: _name(v))
def test_split_k_deterministic_forced_path(k, dtype, path, ms, monkeypatch):
    """Forced grids on the warp-specialized kernel and on the k split: within tolerance, bitwise identical over
    repeats."""
    monkeypatch.setenv("KBIT_GEMM_PATH", path)
    seed = seed_for("splitk-" + path, k, dtype)
    g = gen(seed + 1, "cuda")
    failures = []
    for N, K in SPLITK_SHAPES:
        qw = quantized_weight(N, K, k, seed)
        chk = GemmChecker(qw)
        for M in ms:
            x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
            bias = torch.randn(N, generator=g, device="cuda").to(dtype) if M == ms[1] else None
            for grid in SPLITK_GRIDS:
                first = run_matmul(x, qw, bias, grid_override=grid)
                st = chk.stats(x, bias, first)
                where = f"N={N} K={K} M={M} grid_override={grid}"
                if not st["ok"]:
                    failures.append(f"{where}: {chk.describe(st)}")
                    continue
                ref_bits = _bits(first)
                mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
                for _ in range(max(1, SPLITK_REPS // 10)):
                    mismatches += (_bits(run_matmul(x, qw, bias, grid_override=grid)) != ref_bits).any().to(torch.int64)
                if int(mismatches):
                    failures.append(f"{where}: {int(mismatches)} repeats differ bitwise from the first run")
    assert not failures, tag(seed, op="split-k-" + path, bits=k, dtype=dtype) + "\n  " + "\n  ".join(failures)


@pytest.mark.parametrize("k,dtype", SPLITK_CASES, ids=lambda v: _name(v))
def test_split_k_deterministic(k, dtype):
    """Forced grid sizes: every result within tolerance, bitwise identical over many repeats."""
    seed = seed_for("splitk", k, dtype)
    g = gen(seed + 1, "cuda")
    failures = []
    for N, K in SPLITK_SHAPES:
        qw = quantized_weight(N, K, k, seed)
        chk = GemmChecker(qw)
        for M in (1, 16, 33):
            x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
            bias = torch.randn(N, generator=g, device="cuda").to(dtype) if M == 16 else None
            outs = {}
            for grid in (0,) + SPLITK_GRIDS:
                first = run_matmul(x, qw, bias, grid_override=grid)
                st = chk.stats(x, bias, first)
                where = f"N={N} K={K} M={M} grid_override={grid}"
                if not st["ok"]:
                    failures.append(f"{where}: {chk.describe(st)}")
                    continue
                outs[grid] = first
                ref_bits = _bits(first)
                reps = SPLITK_REPS if grid else 20
                mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
                for _ in range(reps):
                    out = run_matmul(x, qw, bias, grid_override=grid)
                    mismatches += (_bits(out) != ref_bits).any().to(torch.int64)
                    del out
                n_bad = int(mismatches)
                if n_bad:
                    failures.append(f"{where}: {n_bad} of {reps} repeats differ bitwise from the first run")
            # different grids: all near the reference, hence near each other
            if 0 in outs:
                lim = 2 * chk.stats(x, bias, outs[0])["bound"]
                for grid, out in outs.items():
                    d = float((out.float() - outs[0].float()).abs().max())
                    if d > lim:
                        failures.append(f"N={N} K={K} M={M}: grid_override={grid} vs auto differ by {d:.4g} > {lim:.4g}")
    assert not failures, tag(seed, op="split-k", bits=k, dtype=dtype) + "\n  " + "\n  ".join(failures)


def test_split_k_concurrent_streams():
    """Split-K GEMMs running at once on two streams: each stream keeps its own split-K workspace."""
    seed = seed_for("splitk-streams")
    g = gen(seed + 1, "cuda")
    N, K, grid = 4096, 14336, 32  # 16 x 56 steps over 32 CTAs per GEMM: both GEMMs fit on the GPU at once
    weights = [quantized_weight(N, K, 4, seed + i) for i in range(2)]
    xs = [torch.randn(1, K, generator=g, device="cuda").half() for _ in range(2)]
    refs = [run_matmul(x, qw, grid_override=grid) for x, qw in zip(xs, weights)]
    for x, qw, ref in zip(xs, weights, refs):
        st = GemmChecker(qw).stats(x, None, ref)
        assert st["ok"], tag(seed, op="splitk-streams") + ": " + GemmChecker.describe(st)
    streams = [torch.cuda.Stream() for _ in range(2)]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for _ in range(20):
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[i].append(kbit.matmul(xs[i], weights[i], grid_override=grid))
    for st in streams:
        torch.cuda.current_stream().wait_stream(st)
    for i in range(2):
        for rep, out in enumerate(outs[i]):
            assert_bits_equal(out, refs[i], tag(seed, op="splitk-streams") + f": stream {i}, call {rep}")
