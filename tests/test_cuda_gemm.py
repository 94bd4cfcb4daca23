"""The fused GEMM through kbit.matmul as the planner runs it: within the same-precision tolerance on odd and
model shapes, custom codebooks, per-tensor scales, weights written in place, leading dims (tests/cuda_harness.py)."""

from __future__ import annotations

import pytest
import torch

import kbit
from cuda_harness import (BIG_SHAPE, BITS, _bits, GEMM_DTYPES, GEMM_MS, _gemm_sweep, GemmChecker, gen, MODEL_SHAPES,
    _name, quantized_weight, run_matmul, seed_for, SMALL_SHAPES, tag)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
    pytest.mark.usefixtures("ieee_fp32_matmul"),  # fp32 references are real fp32 products (conftest.py)
]


@pytest.mark.parametrize("N,K", SMALL_SHAPES + MODEL_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("k", BITS)
def test_gemm(k, N, K):
    seed = seed_for("gemm", k, N, K)
    qw = quantized_weight(N, K, k, seed)
    _gemm_sweep(qw, seed, GEMM_MS)


@pytest.mark.parametrize("k", BITS)
def test_gemm_big_shape(k):
    N, K = BIG_SHAPE
    seed = seed_for("gemm-big", k)
    qw = quantized_weight(N, K, k, seed)
    # On H100/H200, 64 and 100 take wgmma's 256-row tiles. The weights (66-154 MB) exceed L2 there: up to 16 tokens
    # they are copied evict-first (GemmConfig::kWeightsStreamed), past that too where the warp-specialized kernel
    # runs one token pass (ws_copy_weights).
    _gemm_sweep(qw, seed, (1, 5, 16, 31, 64, 100))
    del qw
    torch.cuda.empty_cache()


@pytest.mark.parametrize("N,K", ((384, 96), (1000, 4128), (4096, 4096), (1536, 2048)), ids=lambda v: str(v))
@pytest.mark.parametrize("k", BITS)
def test_gemm_custom_codebook(k, N, K):
    seed = seed_for("gemm-custom", k, N, K)
    qw = quantized_weight(N, K, k, seed, cb_kind="custom")
    _gemm_sweep(qw, seed, (1, 3, 16, 33, 100), codebook="custom")


@pytest.mark.parametrize("k", BITS)
def test_gemm_tensor_scale(k):
    """Weights far outside E4M4's range: the per-tensor scale goes into the GEMM."""
    seed = seed_for("gemm-scale", k)
    for factor in (1e-4, 50.0):
        W = torch.randn(256, 512, generator=gen(seed, "cuda"), device="cuda") * factor
        qw = kbit.quantize(W.to(torch.bfloat16), k)
        assert float(qw.scale) != 1.0
        qw.gemm_layout()
        _gemm_sweep(qw, seed, (1, 16, 33), factor=factor)


@pytest.mark.parametrize("k", BITS)
def test_gemm_weights_written_in_place(k, monkeypatch):
    """Weights a GEMM has read are fetched early by the next call (before the previous kernel finishes, kbit/ops.py);
    written in place right before a call, they are not: every path reads the new values, bitwise what a GEMM on
    those weights from the start returns, and the call after that (early again) too. 1024 x 4096: the k split's 32
    CTAs (16-row tiles: 64) take at most half the SMs with 2 steps each, so every stage is copied early (GridRoom)."""
    hopper = torch.cuda.get_device_capability()[0] == 9
    seed = seed_for("gemm-in-place", k)
    g = gen(seed + 1, "cuda")
    N, K = 1024, 4096
    new = quantized_weight(N, K, k, seed + 7, cb_kind="custom")
    failures = []
    for path, ms in (("", (1, 16, 64)),) + ((("k_split", (1, 16)), ("mma_sync", (1,)), ("ws", (17, 100))) if hopper
                                            else ()):
        monkeypatch.setenv("KBIT_GEMM_PATH", path)
        for M in ms:
            x = torch.randn(M, K, generator=g, device="cuda").half()
            target = quantized_weight(N, K, k, seed, cb_kind="custom")  # another codebook too
            want = _bits(kbit.matmul(x, new, grid_override=1000))  # the fused kernel on its natural grid
            for _ in range(2):
                kbit.matmul(x, target, grid_override=1000)  # read twice: settled
            # The per-tensor scale too: a power of two from the largest block, it differs between the two weights for
            # ~0.3% of seeds (one of 4M weights past 6.25 sigma), and it is part of what the GEMM reads.
            for mine, theirs in zip(target.gemm_layout() + (target.codebook, target.scale),
                                    new.gemm_layout() + (new.codebook, new.scale)):
                mine.copy_(theirs)
            got = {"right after the write": kbit.matmul(x, target, grid_override=1000),  # the copy: the kernel before
                   "settled again": run_matmul(x, target, grid_override=1000)}
            for call, y in got.items():
                if not torch.equal(_bits(y), want):
                    failures.append(f"path={path or 'planner'} M={M}: {call}, not the new weights' result")
    assert not failures, tag(seed, op="gemm-in-place", bits=k) + "\n  " + "\n  ".join(failures)


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
@pytest.mark.parametrize("k", BITS)
def test_matmul_shapes(k, dtype):
    """Leading batch dims, M = 0, K not a multiple of 32 (and of 8)."""
    seed = seed_for("matmul-shapes", k, dtype)
    g = gen(seed + 1, "cuda")
    failures = []
    for N, K in ((256, 512), (128, 100), (136, 40), (384, 1000)):
        qw = quantized_weight(N, K, k, seed)
        chk = GemmChecker(qw)
        bias = torch.randn(N, generator=g, device="cuda").to(dtype)
        for lead in ((2, 3), (1, 1), (5,), (0,), (2, 0), ()):
            x = torch.randn(*lead, K, generator=g, device="cuda").to(dtype)
            for b in (None, bias):
                out = run_matmul(x, qw, b)
                if tuple(out.shape) != (*lead, N) or out.dtype != dtype:
                    failures.append(f"N={N} K={K} x{tuple(x.shape)}: output {tuple(out.shape)} {out.dtype}")
                    continue
                if out.numel():
                    st = chk.stats(x, b, out)
                    if not st["ok"]:
                        failures.append(f"N={N} K={K} x{tuple(x.shape)} bias={b is not None}: {chk.describe(st)}")
        # a non-contiguous x (a column slice of a wider tensor)
        xw = torch.randn(7, K + 8, generator=g, device="cuda").to(dtype)
        x = xw[:, 4:4 + K]
        out = run_matmul(x, qw, bias)
        st = chk.stats(x, bias, out)
        if not st["ok"]:
            failures.append(f"N={N} K={K} non-contiguous x: {chk.describe(st)}")
    torch.cuda.synchronize()
    assert not failures, tag(seed, op="matmul-shapes", bits=k, dtype=dtype) + "\n  " + "\n  ".join(failures)


@pytest.mark.parametrize("k", (2, 4))
def test_float32_activations_multiply_the_weight_dequantized_to_float32(k):
    """No fused kernel takes float32 x: a float32 model on the GPU multiplies the weight dequantized to float32 with
    cuBLAS, as kbit.matmul does on the CPU (the same product in float32), GEMM-resident weights included."""
    torch.manual_seed(seed_for("fp32", k))
    w = torch.randn(96, 200)
    x, bias = torch.randn(3, 5, 200), torch.randn(96)
    want = kbit.matmul(x, kbit.quantize(w, k), bias)
    qw = kbit.quantize(w.cuda(), k)
    for weight in (qw, kbit.QuantizedWeight.from_gemm_layout(*qw.gemm_layout(), qw.codebook, qw.scale, k, qw.shape,
                                                              torch.float32)):
        got = kbit.matmul(x.cuda(), weight, bias.cuda())
        assert got.dtype == torch.float32 and got.shape == (3, 5, 96)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    with pytest.raises(TypeError, match="grid_override forces the fused kernel"):
        kbit.matmul(x.cuda(), qw, grid_override=4)
