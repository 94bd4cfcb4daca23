"""Tiles cut in parts on thread-block clusters (kbit/csrc/gemm.cuh, GemmConfig::kClustered; compute capability 9.x):
each tile's k-steps in C = 2..8 parts on one cluster of C CTAs, the parts summed through distributed shared memory
(cluster_finish_tile), launched through the extension with tile_parts = C on tiles x C CTAs (the launch arguments
tests and benchmarks force).

Checked against the Python reference (tests/cuda_harness.py: fresh inputs, poisoned outputs, the GEMM tolerance),
bitwise identical over two runs, and, where C divides the k-steps (the parts are then the one-group cut's ranges on the
same grid), bitwise identical to that grid's sum through L2 (finish_tile adds the partials in the same order). The
clustered launch has no split-K workspace: the kernel without clusters, given these parts, would read a null one, so a
correct result is the cluster path's. Refused with a message: parts outside 2..8, grids other than tiles x parts,
more parts than k-steps, configurations other than mma.sync up to 16 tokens, compute capability 8.x. On the CPU: which
configurations may cut tiles in clusters (``GemmConfig.tile_parts_in_clusters``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kbit import formats, gemm_facts, ops, planner
from cuda_harness import (_bits, BITS, GEMM_DTYPES, GemmChecker, gen, _name, needs_hopper, poison, poisoned,
    quantized_weight, seed_for, tag)

pytestmark = pytest.mark.usefixtures("ieee_fp32_matmul")  # fp32 references are real fp32 products (conftest.py)

# (N, K): Llama-3-8B's k/v (4096 -> 1024) and fused q/k/v (4096 -> 6144), 2048 -> 1536, and 4128 -> 1000: 17 k-groups
# (k-steps no C divides: 17, or 3 with the k split) and row tiles past N.
CLUSTER_SHAPES = ((1024, 4096), (6144, 4096), (1536, 2048), (1000, 4128))
CLUSTER_MS = (1, 5, 16)
CLUSTER_PARTS = (2, 3, 4, 5, 7, 8)


def _ext():
    from kbit._build import cuda_ext

    return cuda_ext()


def test_configurations_whose_tiles_are_cut_in_clusters():
    """Of the built configurations (the pinned report), those the binding lets cut tiles in parts on clusters:
    mma.sync at 8 and 16 tokens, with and without the k split, every bit width."""
    pinned = gemm_facts.parse_configs((Path(__file__).parent / "gemm_configs.json").read_text())
    assert {(c.bits, c.mb, c.k_split) for c in pinned if c.tile_parts_in_clusters} == \
        {(k, mb, k_split) for k in BITS for mb in (1, 2) for k_split in (1, 8)}


def _clustered_configs(k: int) -> list:
    """This GPU's configurations at k bits whose tiles may be cut in parts on clusters."""
    facts = planner.device_facts(torch.device("cuda"))
    return [c for c in facts.configs if c.bits == k and c.tile_parts_in_clusters and c.runs_on(facts.device)]


def _steps(config, N: int, K: int, M: int) -> planner.Steps:
    return planner.steps_of(config, planner.Shape(N, formats.padded_in_features(K), M, config.bits))


def _gemm(qw, x, bias, config, grid: int, parts: int, whole_tiles: bool = False, scale=None):
    """The extension's GEMM on a forced launch (the weight's scale, or one per 256 rows), its output poisoned before the
    call."""
    b, a = qw.gemm_layout()
    N, K = qw.shape
    ptrs = poison((x.shape[0] * N, x.dtype))
    scale = qw.scale if scale is None else scale
    y = _ext().gemm(x, b, a, qw.codebook, scale, bias, qw.bits, N, formats.padded_in_features(K), grid, parts,
                    whole_tiles, config.mb, config.wgmma_tiles, config.k_split, config.ws_tokens,
                    ops.weights_settled(b, a, qw.codebook))
    poisoned(ptrs, y)
    return y


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("k", BITS)
def test_tile_parts_summed_in_clusters(k):
    """Every configuration that cuts tiles in parts (mb 1 and 2, k split 1 and 8; block columns at one token), every
    part count that fits (C <= k-steps, tiles x C <= SMs), M = 1, 5, 16, fp16 and bf16, bias on every other call, the
    weight's per-tensor scale: within tolerance of the reference, bitwise identical over two runs and to the same grid
    through L2 where the cuts agree."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    failures, runs = [], 0
    for N, K in CLUSTER_SHAPES:
        seed = seed_for("gemm-cluster-split", k, N, K)
        qw = quantized_weight(N, K, k, seed)
        assert float(qw.scale) != 1.0  # the per-tensor scale is applied in the epilogue
        chk = GemmChecker(qw)
        g = gen(seed + 1, "cuda")
        for i, M in enumerate(CLUSTER_MS):
            for j, dtype in enumerate(GEMM_DTYPES):
                x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
                bias = torch.randn(N, generator=g, device="cuda").to(dtype) if (i + j) % 2 else None
                for config in _clustered_configs(k):
                    steps = _steps(config, N, K, M)
                    for parts in CLUSTER_PARTS:
                        grid = steps.tiles * parts
                        if parts > steps.k_steps or grid > sms:
                            continue
                        where = (f"N={N} K={K} M={M} {_name(dtype)} bias={bias is not None} mb={config.mb} "
                                 f"k_split={config.k_split} parts={parts} grid={grid} (k-steps {steps.k_steps})")
                        y = _gemm(qw, x, bias, config, grid, parts)
                        runs += 1
                        st = chk.stats(x, bias, y)
                        if not st["ok"]:
                            failures.append(f"{where}: {chk.describe(st)}")
                            continue
                        if not torch.equal(_bits(_gemm(qw, x, bias, config, grid, parts)), _bits(y)):
                            failures.append(f"{where}: a second run differs bitwise")
                        if steps.k_steps % parts == 0:
                            through_l2 = _gemm(qw, x, bias, config, grid, 0)
                            if not torch.equal(_bits(through_l2), _bits(y)):
                                failures.append(f"{where}: differs bitwise from the same cut summed through L2")
    assert runs > 0, "no cluster launch fits this GPU"
    assert not failures, tag(seed_for("gemm-cluster-split", k), op="gemm tile parts in clusters", bits=k) + "\n  " + \
        "\n  ".join(failures)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
def test_row_scales_in_clusters(dtype):
    """Sibling projections fused into one launch (4096 -> 6144: q, k, v), a scale per 256 output rows (powers of two
    times the weight's): each block within tolerance of the reference times its factor, and bitwise the same grid's
    sum through L2."""
    N, K = 6144, 4096
    seed = seed_for("gemm-cluster-row-scales", dtype)
    qw = quantized_weight(N, K, 4, seed)
    chk = GemmChecker(qw)
    g = gen(seed + 1, "cuda")
    factors = 2.0 ** torch.randint(-1, 3, (N // 256,), generator=g, device="cuda").float()
    row_factors = factors.repeat_interleave(256)
    failures = []
    for M in (1, 16):
        x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
        for config in _clustered_configs(4):
            steps = _steps(config, N, K, M)
            parts = 4  # 16 k-steps: the same cut as one group on tiles x 4 CTAs
            if steps.k_steps != 16 or steps.tiles * parts > torch.cuda.get_device_properties(0).multi_processor_count:
                continue
            grid = steps.tiles * parts
            y = _gemm(qw, x, None, config, grid, parts, scale=qw.scale * factors)
            where = f"M={M} mb={config.mb} k_split={config.k_split} parts={parts} grid={grid}"
            st = chk.stats(x, None, y.float() / row_factors)
            if not st["ok"]:
                failures.append(f"{where}: {chk.describe(st)}")
            through_l2 = _gemm(qw, x, None, config, grid, 0, scale=qw.scale * factors)
            if not torch.equal(_bits(through_l2), _bits(y)):
                failures.append(f"{where}: differs bitwise from the same cut summed through L2")
    assert not failures, tag(seed, op="gemm tile parts in clusters, row scales", dtype=dtype) + "\n  " + \
        "\n  ".join(failures)


def _config(k: int, mb: int, k_split: int = 1, wgmma_tiles: int = 0):
    facts = planner.device_facts(torch.device("cuda"))
    return next(c for c in facts.configs if c.bits == k and c.key == (mb, wgmma_tiles, 0, k_split))


@pytest.mark.cuda
@needs_hopper
def test_tile_parts_refused():
    """Launches the binding refuses, each with its reason: more parts than a cluster holds, one part, a grid that is not
    tiles x parts, whole tiles on mma.sync, parts past 16 tokens or on the wgmma path, more parts than k-steps."""
    N, K, M = 1024, 4096, 1
    qw = quantized_weight(N, K, 4, seed_for("gemm-cluster-refused"))
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    one_token = _config(4, 1)
    tiles = _steps(one_token, N, K, M).tiles  # 4 tiles of 16 k-steps
    assert _gemm(qw, x, None, one_token, tiles * 8, 8).shape == (M, N)  # the largest cluster runs
    cases = [
        (one_token, tiles * 9, 9, False, "more parts than one thread-block cluster holds"),
        (one_token, tiles, 1, False, "not 2 to k-steps per tile on tiles x parts CTAs"),
        (one_token, tiles * 2 + 1, 2, False, "not 2 to k-steps per tile on tiles x parts CTAs"),
        (one_token, tiles * 2, 2, True, "only the warp-specialized kernel"),
        (_config(4, 4), 4 * 2, 2, False, "mma.sync up to 16 tokens only"),
        (_config(4, 8, wgmma_tiles=2), 4 * 2, 2, False, "mma.sync up to 16 tokens only"),
    ]
    # More parts than k-steps is more CTAs than steps: the k split's 32 tiles here have 2 k-steps each.
    k_split = _config(4, 1, k_split=8)
    assert _steps(k_split, N, K, M).k_steps == 2
    cases.append((k_split, _steps(k_split, N, K, M).tiles * 3, 3, False, "has more CTAs than steps"))
    for config, grid, parts, whole, reason in cases:
        with pytest.raises(RuntimeError, match=f"the launch grid={grid}, tile_parts={parts}.*{reason}"):
            _gemm(qw, x, None, config, grid, parts, whole)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 9,
                    reason="compute capability 8.x: no thread-block clusters")
def test_tile_parts_refused_without_clusters():
    """Compute capability 8.x has no clusters: tile parts on mma.sync (k = 2 at 8 tokens, built for it) are refused
    before any launch."""
    N, K, M = 1024, 4096, 1
    qw = quantized_weight(N, K, 2, seed_for("gemm-cluster-sm80"))
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    config = _config(2, 1)
    with pytest.raises(RuntimeError, match="need compute capability 9.0"):
        _gemm(qw, x, None, config, _steps(config, N, K, M).tiles * 2, 2)
