"""Small, fast tests for compute-sanitizer (memcheck, racecheck), selected with ``-k sanitize``: CPU references
only (no cuBLAS), no poisoning (the sanitizer run disables caching); and malformed input refused by the binding."""

from __future__ import annotations

import pytest
import torch

import kbit
import kbit.functional
from kbit import formats, layout, ops
from cuda_harness import assert_bits_equal, BITS, blocky_tensor, gen, needs_hopper, random_storage, seed_for, tag

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
    pytest.mark.usefixtures("ieee_fp32_matmul"),  # fp32 references are real fp32 products (conftest.py)
]


# ----------------------------------------------------------------------------- compute-sanitizer subset
# Small and fast: run under `compute-sanitizer --tool memcheck|racecheck pytest -k sanitize`.
# They use CPU references only (no cuBLAS), and no poisoning (the sanitizer run disables caching).
def _cpu_gemm_check(out: torch.Tensor, x: torch.Tensor, qw: kbit.QuantizedWeight, bias, msg: str) -> None:
    ref = x.cpu().float() @ kbit.dequantize(qw.cpu(), torch.float32).T
    if bias is not None:
        ref = ref + bias.cpu().float()
    o = out.cpu().float()
    assert o.shape == ref.shape, f"{msg}: shape {tuple(o.shape)} vs {tuple(ref.shape)}"
    assert bool(torch.isfinite(o).all()), f"{msg}: non-finite output"
    if not o.numel():
        return
    tol = (0.02 if x.dtype == torch.bfloat16 else 0.005) * max(float(ref.abs().max()), 1e-6)
    err = float((o - ref).abs().max())
    assert err <= tol, f"{msg}: max error {err:.4g} > {tol:.4g}"


@pytest.mark.parametrize("k", BITS)
def test_sanitize_quantize_dequantize(k):
    seed = seed_for("sanitize-qdq", k)
    for n in (33, 8192 + 17):
        A = blocky_tensor(n, torch.float16, seed)
        cb = kbit.functional.create_normal_float_codebook(k)
        one = torch.ones(())
        want_p, want_a = formats.quantize_reference(A, cb, k, one)
        got_p, got_a = ops.quantize(A.cuda(), cb.cuda(), k, one.cuda())
        msg = tag(seed, op="sanitize-quantize", bits=k, n=n)
        assert_bits_equal(got_p, want_p, msg)
        assert_bits_equal(got_a, want_a, msg)
        for dtype in (torch.float16, torch.float32):
            got = ops.dequantize(got_p, got_a, cb.cuda(), k, n, dtype, one.cuda())
            want = formats.dequantize_reference(want_p, want_a, cb, k, n, dtype, one)
            assert_bits_equal(got, want, tag(seed, op="sanitize-dequantize", bits=k, n=n, dtype=dtype))


@pytest.mark.parametrize("k", BITS)
def test_sanitize_repack(k):
    seed = seed_for("sanitize-repack", k)
    for N, in_features_padded in ((1000, 96), (128, 4128)):
        packed, absmax = random_storage(N * in_features_padded, k, seed)
        want_b, want_a = layout.repack_reference(packed, absmax, k, N, in_features_padded)
        got_b, got_a = ops.repack(packed.cuda(), absmax.cuda(), k, N, in_features_padded)
        msg = tag(seed, op="sanitize-repack", bits=k, N=N, in_features_padded=in_features_padded)
        assert_bits_equal(got_b, want_b, msg)
        assert_bits_equal(got_a, want_a, msg)


@pytest.mark.parametrize("k", BITS)
def test_sanitize_gemm(k, monkeypatch):
    seed = seed_for("sanitize-gemm", k)
    g = gen(seed)
    hopper = torch.cuda.get_device_capability()[0] == 9
    for N, K in ((200, 1056), (136, 4104), (128, 100)):
        W = torch.randn(N, K, generator=g) * 0.02
        qw = kbit.quantize(W.half().cuda(), k)
        for dtype in ((torch.float16, torch.bfloat16) if k == 4 else (torch.float16,)):
            # the planner's choice, then (where they are built) up to 16 tokens the k split forced, and the
            # warp-specialized kernel on forced grids (split-K: one CTA reduces up to 16 others' partials)
            cases = {"": ((1, 0), (17, 0), (1, 7), (33, 1000), (0, 0)),
                     "k_split": ((1, 0), (5, 0), (1, 7), (12, 0), (16, 5)),
                     "ws": ((17, 1000), (40, 7), (100, 3))}
            for path in ("", "k_split", "ws") if hopper else ("",):
                monkeypatch.setenv("KBIT_GEMM_PATH", path)
                for M, grid in cases[path]:
                    x = torch.randn(M, K, generator=g).to(dtype).cuda()
                    bias = torch.randn(N, generator=g).to(dtype).cuda() if M in (5, 17) else None
                    out = kbit.matmul(x, qw, bias, grid_override=grid)
                    _cpu_gemm_check(out, x, qw, bias, tag(seed, op="sanitize-gemm", bits=k, N=N, K=K, M=M,
                                                            dtype=dtype, grid_override=grid, path=path))
    if hopper:  # the warp-specialized kernel's planned grid cutting tiles of 11 k-groups in parts one apart (cut.h):
        monkeypatch.setenv("KBIT_GEMM_PATH", "ws")  # 16 tiles in 8 parts of 1-2, at 100 tokens (k < 5) 32 in 4 of 2-3
        N, K = 4096, 2816
        qw = kbit.quantize((torch.randn(N, K, generator=g) * 0.02).half().cuda(), k)
        b, a = qw.gemm_layout()
        for M in (17, 100):  # the fused op (kbit.matmul takes dequantize + cuBLAS for weights this small)
            x = torch.randn(M, K, generator=g).half().cuda()
            out = ops.gemm(x, b, a, qw.codebook, qw.scale, None, k, N, qw.in_features_padded, 0)
            _cpu_gemm_check(out, x, qw, None, tag(seed, op="sanitize-gemm", bits=k, N=N, K=K, M=M, path="ws"))
    torch.cuda.synchronize()


@needs_hopper
@pytest.mark.parametrize("k", BITS)
def test_sanitize_gemm_clusters(k, monkeypatch):
    """Tiles in halves summed in clusters of two (ws_cluster_reduce; KBIT_WS_CLUSTERS=1 fails the launch where they
    do not fit, so a pass is the cluster path): 512 x 1024 at 17 tokens, 2 tiles of 4 k-groups on 4 CTAs."""
    seed = seed_for("sanitize-gemm-clusters", k)
    g = gen(seed)
    monkeypatch.setenv("KBIT_GEMM_PATH", "ws")
    monkeypatch.setenv("KBIT_WS_CLUSTERS", "1")
    N, K, M = 512, 1024, 17
    qw = kbit.quantize((torch.randn(N, K, generator=g) * 0.02).half().cuda(), k)
    b, a = qw.gemm_layout()
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(M, K, generator=g).to(dtype).cuda()
        out = ops.gemm(x, b, a, qw.codebook, qw.scale, None, k, N, qw.in_features_padded, 0)
        _cpu_gemm_check(out, x, qw, None, tag(seed, op="sanitize-gemm-clusters", bits=k, N=N, K=K, M=M, dtype=dtype))
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- malformed input reaches the binding
def _malformed_cases():
    """(name, call) pairs that hand the CUDA binding crafted tensors directly, bypassing kbit's Python checks."""
    from kbit._build import cuda_ext

    ext = cuda_ext()
    k, N, K = 4, 256, 512
    W = torch.randn(N, K, device="cuda").half() * 0.02
    qw = kbit.quantize(W, k)
    b, a = qw.gemm_layout()
    cb, s, x = qw.codebook, qw.scale, torch.randn(3, K, device="cuda").half()
    n = N * K
    as_u8 = qw.packed.to(torch.uint8)  # same element count, a quarter of the bytes
    config = (1, 0, 1, 0, False)  # mb, wgmma_tiles, k_split, ws_tokens (built: the tensor checks come first), settled
    return [
        ("dequantize packed uint8", lambda: ext.dequantize(as_u8, qw.absmax, cb, k, n, torch.float16, s)),
        ("dequantize packed float32", lambda: ext.dequantize(qw.packed.float(), qw.absmax, cb, k, n, torch.float16, s)),
        ("dequantize n too large", lambda: ext.dequantize(qw.packed, qw.absmax, cb, k, n + 4096, torch.float16, s)),
        ("dequantize short codebook", lambda: ext.dequantize(qw.packed, qw.absmax, cb[:8], k, n, torch.float16, s)),
        ("dequantize scale int", lambda: ext.dequantize(qw.packed, qw.absmax, cb, k, n, torch.float16, s.int())),
        ("dequantize bits=6", lambda: ext.dequantize(qw.packed, qw.absmax, cb, 6, n, torch.float16, s)),
        ("dequantize int8 out", lambda: ext.dequantize(qw.packed, qw.absmax, cb, k, n, torch.int8, s)),
        ("dequantize codebook on cpu", lambda: ext.dequantize(qw.packed, qw.absmax, cb.cpu(), k, n, torch.float16, s)),
        ("dequantize strided packed", lambda: ext.dequantize(torch.stack([qw.packed, qw.packed], 1)[:, 0], qw.absmax,
                                                             cb, k, n, torch.float16, s)),
        ("repack packed uint8", lambda: ext.repack(as_u8, qw.absmax, k, N, K)),
        ("repack absmax int32", lambda: ext.repack(qw.packed, qw.absmax.int(), k, N, K)),
        ("repack K 50", lambda: ext.repack(qw.packed, qw.absmax, k, N, 50)),
        ("repack N larger", lambda: ext.repack(qw.packed, qw.absmax, k, N * 2, K)),
        ("repack N negative", lambda: ext.repack(qw.packed, qw.absmax, k, -N, -K)),
        ("gemm b_gemm int64", lambda: ext.gemm(x, b.long(), a, cb, s, None, k, N, K, 1, 0, False, *config)),
        ("gemm b_gemm short", lambda: ext.gemm(x, b[:-1], a, cb, s, None, k, N, K, 1, 0, False, *config)),
        ("gemm layout for a larger N", lambda: ext.gemm(x, b, a, cb, s, None, k, N * 4, K, 1, 0, False, *config)),
        ("gemm layout for a larger K", lambda: ext.gemm(x, b, a, cb, s, None, k, N, K * 4, 1, 0, False, *config)),
        ("gemm absmax float", lambda: ext.gemm(x, b, a.float(), cb, s, None, k, N, K, 1, 0, False, *config)),
        ("gemm codebook short", lambda: ext.gemm(x, b, a, cb[:4], s, None, k, N, K, 1, 0, False, *config)),
        ("gemm scale on cpu", lambda: ext.gemm(x, b, a, cb, s.cpu(), None, k, N, K, 1, 0, False, *config)),
        ("gemm bias short", lambda: ext.gemm(x, b, a, cb, s, torch.zeros(N - 1, device="cuda").half(), k, N, K,
                                             1, 0, False, *config)),
        ("gemm bias bf16", lambda: ext.gemm(x, b, a, cb, s, torch.zeros(N, device="cuda").bfloat16(), k, N, K,
                                            1, 0, False, *config)),
        ("gemm x too wide", lambda: ext.gemm(torch.randn(3, K + 8, device="cuda").half(), b, a, cb, s, None, k, N,
                                             K, 1, 0, False, *config)),
        ("gemm k mismatch", lambda: ext.gemm(x, b, a, cb, s, None, 3, N, K, 1, 0, False, *config)),
        ("gemm configuration not built", lambda: ext.gemm(x, b, a, cb, s, None, k, N, K, 1, 0, False, 3, 0, 1, 0,
                                                          False)),
        ("quantize short codebook", lambda: ext.quantize(W, cb[:4], k, s)),
        ("quantize codebook float16", lambda: ext.quantize(W, cb.half(), k, s)),
    ]


def test_sanitize_malformed_tensors_are_refused_by_the_binding():
    """Every crafted tensor gets a 'kbit:' error before any kernel runs (compute-sanitizer sees no access)."""
    for name, call in _malformed_cases():
        print(f"malformed case: {name}", flush=True)
        with pytest.raises(RuntimeError, match="kbit: "):
            call()
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def test_sanitize_malformed_checkpoint_on_cuda():
    """The report's exploit end to end on the GPU: packed stored as another dtype, loaded into a CUDA layer."""
    layer = kbit.KbitLinear.from_linear(torch.nn.Linear(256, 128).half().cuda(), bits=4)
    state = layer.state_dict()
    for dtype in (torch.uint8, torch.int16, torch.float32):
        bad = dict(state, packed=state["packed"].to(dtype))
        with pytest.raises(RuntimeError, match="packed must be int32"):
            layer.load_state_dict(bad)
        with pytest.raises(TypeError, match="packed must be int32"):
            kbit.QuantizedWeight.from_state_dict(bad)
    y = layer(torch.randn(2, 256, device="cuda").half())  # the refused loads left a working layer
    assert bool(torch.isfinite(y).all())
    torch.cuda.synchronize()
