"""Each fused GEMM kernel forced (KBIT_GEMM_PATH): the warp-specialized kernel at every tile width, tiles cut in
parts and in clusters, grids of whole tiles, and the k split (compute capability 9.x; tests/cuda_harness.py)."""

from __future__ import annotations

import pytest
import torch

import kbit
from kbit import formats, ops, planner
from cuda_harness import (BITS, _gemm_sweep, GEMM_DTYPES, GemmChecker, gen, make_codebook, MODEL_SHAPES, _name,
    needs_hopper, quantized_weight, random_storage, seed_for, SMALL_SHAPES, tag)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
    pytest.mark.usefixtures("ieee_fp32_matmul"),  # fp32 references are real fp32 products (conftest.py)
]


# ----------------------------------------------------------------------------- mma.sync, 16 and 32 tokens per pass
# gemm.cuh's mma.sync at 9-32 tokens (mb = 2, with and without the k split, and mb = 4) multiplies each block's
# looked-up weights by its E4M4 scale in 16 bits (GemmConfig::kScaleWeights), the scales in a unit of 2^-4 (fp16) or
# 2^-116 (bf16) that the lookup table undoes. Storage of every code and E4M4 scale, and of scales all below E4M4's
# normal range (< 2^-10: subnormal in that unit, in both types), so that a flushed subnormal shows as outputs of zero.
SCALED_WEIGHTS_MS = {2: (9, 13, 16), 4: (17, 31)}


@pytest.mark.parametrize("k", BITS)
def test_gemm_mma_sync_scales_the_weights(k):
    """Every mb = 2 and 4 configuration of gemm.cuh that runs here, on each launch the planner compares (one group of
    CTAs; a CTA per tile with the k split), a partial last token tile and a full one, fp16 and bf16, bias on every
    other call: within the same-precision tolerance of the dequantized reference."""
    from kbit._build import cuda_ext

    ext = cuda_ext()
    facts = planner.device_facts(torch.device("cuda"))
    configs = [c for c in facts.configs if c.bits == k and c.mb in SCALED_WEIGHTS_MS and not c.wgmma_tiles
               and not c.ws_tokens and c.runs_on(facts.device)]
    assert configs, f"no mma.sync configuration of 16 or 32 tokens at k={k} runs here"
    N, K = 384, 1056  # 33 blocks per row: a partial k-group
    in_features_padded = formats.padded_in_features(K)
    failures = []
    for scales in ("every E4M4 code", "subnormal E4M4 codes"):
        seed = seed_for("gemm-mma-sync-scaled-weights", k, scales)
        packed, absmax = random_storage(N * in_features_padded, k, seed)
        if scales.startswith("subnormal"):
            absmax &= 0x0F  # exponent field 0: m * 2^-14
        qw = kbit.QuantizedWeight(packed.cuda(), absmax.cuda(), make_codebook(k, "nf", seed).cuda(),
                                  torch.ones((), device="cuda"), k, (N, K), torch.float16)
        b, a = qw.gemm_layout()
        settled = ops.weights_settled(b, a, qw.codebook)
        chk = GemmChecker(qw)
        g = gen(seed + 1, "cuda")
        calls = 0
        for config in configs:
            for M in SCALED_WEIGHTS_MS[config.mb]:
                steps = planner.steps_of(config, planner.Shape(N, in_features_padded, M, k))
                for dtype in GEMM_DTYPES:
                    x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
                    bias = torch.randn(N, generator=g, device="cuda").to(dtype) if calls % 2 else None
                    for launch in planner.launches(config, steps, facts.device.sms):
                        y = ext.gemm(x, b, a, qw.codebook, qw.scale, bias, k, N, in_features_padded, *launch,
                                     config.mb, config.wgmma_tiles, config.k_split, config.ws_tokens, settled)
                        calls += 1
                        st = chk.stats(x, bias, y)
                        if not st["ok"]:
                            failures.append(f"{scales} mb={config.mb} k_split={config.k_split} M={M} {_name(dtype)} "
                                            f"grid={launch.grid}: {chk.describe(st)}")
    assert not failures, tag(seed_for("gemm-mma-sync-scaled-weights", k), op="gemm mma.sync mb 2, 4", bits=k) + \
        "\n  " + "\n  ".join(failures)


# ----------------------------------------------------------------------------- warp-specialized kernel (sm_90a)
# gemm_ws.cuh, forced with KBIT_GEMM_PATH=ws at every M (32, 64, 128 or 256 tokens per tile, several passes past
# 128), through the fused op (grid_override = 1000: one CTA per SM, tiles split across CTAs where the cut falls inside
# them; never dequantize + cuBLAS). The planned grids of whole tiles: the two tests after it.
WS_MS = (1, 5, 17, 32, 33, 64, 65, 100, 128, 129, 256, 300, 1000)
WS_SHAPES = ((4096, 4096), (1000, 4128), (256, 40), (130, 4104), (1536, 2048), (72, 100), (14336, 4096))


# gemm.cuh with the warps splitting 32-row (16-row at 9-16 tokens) tiles' k-groups, forced with KBIT_GEMM_PATH=k_split
# up to 16 tokens (a k range that ends inside a step, tiles past N, one CTA per tile or a forced grid that splits tiles
# across CTAs).
K_SPLIT_MS = (1, 2, 3, 5, 8, 9, 13, 16)
FORCED_PATH_CASES = ([("ws", WS_MS, N, K) for N, K in WS_SHAPES] +
                     [("k_split", K_SPLIT_MS, N, K) for N, K in SMALL_SHAPES + MODEL_SHAPES])


def _launch(k: int, key: tuple, M: int, N: int, K: int, grid: int = 0) -> tuple:
    """(grid, tile_parts, whole_tiles): ``grid`` CTAs > 0 (one per SM at most), the steps in one group; else the
    planner's launch of the configuration ``key``."""
    facts = planner.device_facts(torch.device("cuda"))
    config = next(c for c in facts.configs if c.bits == k and c.key == key)
    shape = planner.Shape(N, formats.padded_in_features(K), M, k)
    if grid:
        return min(grid, facts.device.sms, planner.steps_of(config, shape).total), 0, False
    return tuple(planner.best_launch(config, shape, facts.coefficients.cut, facts.device.sms))


@needs_hopper
@pytest.mark.parametrize("path,ms,N,K", FORCED_PATH_CASES, ids=lambda v: "ms" if isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("k", BITS)
def test_gemm_forced_path(k, path, ms, N, K, monkeypatch):
    monkeypatch.setenv("KBIT_GEMM_PATH", path)
    seed = seed_for("gemm-" + path, k, N, K)
    qw = quantized_weight(N, K, k, seed)
    _gemm_sweep(qw, seed, ms, grid_override=1000, path=path)


@needs_hopper
@pytest.mark.parametrize("k", BITS)
def test_gemm_ws_256_token_tiles(k):
    """The warp-specialized kernel's 256-token tiles (128-row CTA tiles, the activations' own ring of boxes), called
    through the extension whatever the planner picks: tiles past N and M, several passes, forced grids that split
    tiles across CTAs (the lead's sum and the slices), a grid of whole tiles (4096x4096 at 1000 tokens: 128 tiles),
    whole tiles one apart on the fewest CTAs for the most each (of 132 SMs: 14336x512 at 1000 and 2560 tokens, 448
    and 1120 tiles on 112 and 125 CTAs; 4096x4096 at 2560, 320 tiles on 107), fp16 and bf16, bias on every other
    call."""
    from kbit._build import cuda_ext

    ext = cuda_ext()
    failures = []
    for N, K in ((4096, 4096), (1000, 4128), (130, 4104), (1536, 2048), (72, 100), (14336, 512)):
        seed = seed_for("gemm-ws256", k, N, K)
        qw = quantized_weight(N, K, k, seed)
        b, a = qw.gemm_layout()
        in_features_padded = formats.padded_in_features(K)
        chk = GemmChecker(qw)
        g = gen(seed + 1, "cuda")
        settled = ops.weights_settled(b, a, qw.codebook)
        cases = ((1, 0), (17, 7), (256, 0), (300, 3), (600, 64), (257, 1000), (1000, 0), (2560, 0))
        for i, (M, grid) in enumerate(cases):
            dtype = torch.bfloat16 if i % 3 == 2 else torch.float16
            x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
            bias = torch.randn(N, generator=g, device="cuda").to(dtype) if i % 2 else None
            launch = _launch(k, (32, 0, 256, 1), M, N, K, grid)
            y = ext.gemm(x, b, a, qw.codebook, qw.scale, bias, k, N, in_features_padded, *launch, 32, 0, 1, 256,
                         settled)
            st = chk.stats(x, bias, y)
            if not st["ok"]:
                failures.append(f"N={N} K={K} seed={seed} M={M} grid={grid} {_name(dtype)}: {chk.describe(st)}")
    assert not failures, tag(seed_for("gemm-ws256", k), op="gemm ws_tokens=256", bits=k) + "\n  " + "\n  ".join(failures)


# The warp-specialized kernel's 128-row tiles below 256 tokens (two consumer warpgroups; wgmma_tiles = 1 in the key),
# (tokens per tile, N, K, M, grid, tile_parts, whole_tiles): one group of CTAs whose cut falls inside tiles (lead sums,
# and slices where a tile spans 5 CTAs or more), tiles cut in parts (2 in a cluster where it fits, 3 through L2, 8), grids of whole tiles, tiles past N and a last pass the tokens do not fill, a k range of one k-group.
TILES128_CASES = ((32, 4096, 14336, 32, 132, 0, False), (32, 4096, 4096, 17, 64, 2, False),
                  (32, 1000, 4128, 33, 7, 0, False), (64, 4096, 4096, 64, 132, 0, False),
                  (64, 11008, 4096, 100, 86, 0, True), (64, 4104, 130, 65, 3, 0, False),
                  (128, 4096, 14336, 128, 128, 4, False), (128, 4096, 2048, 200, 64, 0, True),
                  (128, 1536, 2048, 129, 132, 0, False), (128, 72, 100, 128, 1, 0, False),
                  (32, 2048, 4096, 20, 128, 8, False), (64, 4096, 2816, 64, 96, 3, False))


@needs_hopper
@pytest.mark.parametrize("k", BITS)
def test_gemm_ws_128_row_tiles(k):
    """Every 128-row tile configuration of the warp-specialized kernel, on the launches of TILES128_CASES, against the
    reference: fp16 and bf16, bias on every other call."""
    from kbit._build import cuda_ext

    ext = cuda_ext()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    failures, calls = [], 0
    for i, (tokens, N, K, M, grid, parts, whole) in enumerate(TILES128_CASES):
        if grid > sms:  # (the cases' grids are for 132 SMs)
            continue
        seed = seed_for("gemm-ws-tiles128", k, N, K)
        qw = quantized_weight(N, K, k, seed)
        b, a = qw.gemm_layout()
        chk = GemmChecker(qw)
        g = gen(seed + 1, "cuda")
        dtype = torch.bfloat16 if i % 2 else torch.float16
        x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
        bias = torch.randn(N, generator=g, device="cuda").to(dtype) if i % 2 == 0 else None
        y = ext.gemm(x, b, a, qw.codebook, qw.scale, bias, k, N, formats.padded_in_features(K), grid, parts, whole,
                     tokens // 8, 1, 1, tokens, ops.weights_settled(b, a, qw.codebook))
        calls += 1
        st = chk.stats(x, bias, y)
        if not st["ok"]:
            failures.append(f"N={N} K={K} M={M} {tokens} tokens per tile, grid={grid} parts={parts} whole={whole} "
                            f"{_name(dtype)}: {chk.describe(st)}")
    assert calls >= 10 and not failures, tag(seed_for("gemm-ws-tiles128", k), op="gemm ws 128-row tiles", bits=k) + \
        "\n  " + "\n  ".join(failures)


# Tiles cut in parts (cut.h; the parts named are those the planner would cut for 132 SMs), (tokens per
# tile, N, K, M, parts): every tile width, parts of one k-group to six, halves where the k-groups are few (40 tiles of
# 8 and 64 of 2), and 16 parts, past a cluster's 8 CTAs (summed through L2 in every mode). On the H100 and H200 only
# clusters of two fit the planned grids (66 at once; of 3, 4, 8: 39, 30, 15, short of the 43, 32, 16 tiles).
CLUSTER_CASES = ((32, 16384, 512, 17, 2), (32, 10240, 2048, 32, 2), (32, 11008, 768, 32, 3), (64, 4096, 2816, 100, 4),
                 (32, 5632, 1536, 30, 6), (32, 4096, 2816, 17, 8), (128, 4096, 2048, 200, 4),
                 (256, 4096, 1024, 300, 2), (32, 2048, 4096, 20, 16))


@needs_hopper
@pytest.mark.parametrize("k", BITS)
def test_gemm_ws_tile_parts_in_clusters(k, monkeypatch):
    """The parts of a tile summed in a thread-block cluster's shared memory where the GPU holds the clusters
    (KBIT_WS_CLUSTERS=1 for two parts: the launch fails where they do not fit, so a pass is the cluster path; unset
    otherwise) and through L2 (=0), against the reference: fp16 and bf16, bias on every other call, a last pass the
    tokens do not fill."""
    from kbit._build import cuda_ext

    ext = cuda_ext()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    failures = []
    for tokens, N, K, M, parts in CLUSTER_CASES:
        seed = seed_for("gemm-ws-clusters", k, N, K)
        qw = quantized_weight(N, K, k, seed)
        b, a = qw.gemm_layout()
        chk = GemmChecker(qw)
        g = gen(seed + 1, "cuda")
        for i, use in enumerate(("1" if parts == 2 and sms == 132 else "", "0")):
            monkeypatch.setenv("KBIT_WS_CLUSTERS", use)
            dtype = torch.bfloat16 if (i + parts) % 2 else torch.float16
            x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
            bias = torch.randn(N, generator=g, device="cuda").to(dtype) if i % 2 == 0 else None
            tiles = -(-M // tokens) * -(-N // (128 if tokens == 256 else 256))
            cut = min(parts, sms // tiles)  # the parts of 132 SMs, as many as this GPU holds
            if cut < 2:
                continue
            y = ext.gemm(x, b, a, qw.codebook, qw.scale, bias, k, N, formats.padded_in_features(K), tiles * cut, cut,
                         False, tokens // 8, 0, 1, tokens, ops.weights_settled(b, a, qw.codebook))
            st = chk.stats(x, bias, y)
            if not st["ok"]:
                failures.append(f"N={N} K={K} M={M} {tokens} tokens per tile, {parts} parts, KBIT_WS_CLUSTERS={use}, "
                                f"{_name(dtype)}: {chk.describe(st)}")
    assert not failures, tag(seed_for("gemm-ws-clusters", k), op="gemm ws tile parts", bits=k) + "\n  " + \
        "\n  ".join(failures)


@needs_hopper
@pytest.mark.parametrize("k", BITS)
def test_gemm_ws_whole_tiles_grid_128_token_tiles(k):
    """128-token tiles on the grid the host plans where every SM gets two or more: 4096x4096 at 4096 tokens is 512
    tiles of 256 rows, 4 whole tiles on each of 128 CTAs."""
    from kbit._build import cuda_ext

    N, K, M = 4096, 4096, 4096
    seed = seed_for("gemm-ws-whole", k)
    qw = quantized_weight(N, K, k, seed)
    b, a = qw.gemm_layout()
    g = gen(seed + 1, "cuda")
    x = torch.randn(M, K, generator=g, device="cuda").half()
    bias = torch.randn(N, generator=g, device="cuda").half()
    y = cuda_ext().gemm(x, b, a, qw.codebook, qw.scale, bias, k, N, formats.padded_in_features(K), 128, 0, True, 16,
                        0, 1, 128, ops.weights_settled(b, a, qw.codebook))
    chk = GemmChecker(qw)
    st = chk.stats(x, bias, y)
    assert st["ok"], tag(seed, op="gemm ws_tokens=128, whole tiles", bits=k) + " " + chk.describe(st)


@needs_hopper
@pytest.mark.parametrize("k", BITS)
def test_gemm_custom_codebook_forced_ws(k, monkeypatch):
    """The warp-specialized kernel with a random asymmetric codebook (its own pair tables), every tile width."""
    monkeypatch.setenv("KBIT_GEMM_PATH", "ws")
    for N, K in ((1000, 4128), (1536, 2048)):
        seed = seed_for("gemm-custom-ws", k, N, K)
        qw = quantized_weight(N, K, k, seed, cb_kind="custom")
        _gemm_sweep(qw, seed, (17, 33, 64, 100, 129), codebook="custom")
