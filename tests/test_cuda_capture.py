"""CUDA-graph capture and torch.compile(fullgraph=True) of the ops and of KbitLinear (tests/cuda_harness.py)."""

from __future__ import annotations

import pytest
import torch

import kbit
import kbit.functional
from kbit import formats, ops
from cuda_harness import (assert_bits_equal, assert_no_nan, BITS, blocky_tensor, _capture, GEMM_DTYPES, GemmChecker,
    gen, _name, quantized_weight, random_storage, seed_for, tag)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
    pytest.mark.usefixtures("ieee_fp32_matmul"),  # fp32 references are real fp32 products (conftest.py)
]


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("grid_override,on_warmup_stream", [(0, False), (7, False), (7, True)])
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
@pytest.mark.parametrize("k", BITS)
def test_cuda_graph_matmul(k, dtype, grid_override, on_warmup_stream):
    seed = seed_for("graph-matmul", k, dtype, grid_override, on_warmup_stream)
    g = gen(seed + 1, "cuda")
    N, K = 1536, 2048
    qw = quantized_weight(N, K, k, seed)
    bias = torch.randn(N, generator=g, device="cuda").to(dtype)
    for M in (1, 16):
        msg = tag(seed, op="graph-matmul", bits=k, dtype=dtype, M=M, grid_override=grid_override)
        static_x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
        graph, static_y = _capture(lambda: kbit.matmul(static_x, qw, bias, grid_override=grid_override),
                                   on_warmup_stream=on_warmup_stream)
        for trial in range(3):
            static_x.copy_(torch.randn(M, K, generator=g, device="cuda").to(dtype))
            graph.replay()
            eager = kbit.matmul(static_x, qw, bias, grid_override=grid_override)
            assert_bits_equal(static_y, eager, f"graph replay {trial} vs eager {msg}")
        st = GemmChecker(qw).stats(static_x, bias, static_y)
        assert st["ok"], f"{msg}: {GemmChecker.describe(st)}"
        del graph


@pytest.mark.parametrize("k", BITS)
def test_cuda_graph_quantize_dequantize(k):
    seed = seed_for("graph-qdq", k)
    n = 8192 * 3 + 17
    nb = formats.block_count(n)
    cb = kbit.functional.create_normal_float_codebook(k, device="cuda")
    one = torch.ones((), device="cuda")
    static_A = torch.empty(n, dtype=torch.float16, device="cuda")
    static_p = torch.empty(nb * k, dtype=torch.int32, device="cuda")
    static_a = torch.empty(nb, dtype=torch.uint8, device="cuda")
    static_A.copy_(blocky_tensor(n, torch.float16, seed))
    gq, (qp, qa) = _capture(lambda: ops.quantize(static_A, cb, k, one))
    gd, deq = _capture(lambda: ops.dequantize(static_p, static_a, cb, k, n, torch.bfloat16, one))
    for trial in range(3):
        s = seed + 100 + trial
        msg = tag(s, op="graph-quantize/dequantize", bits=k, n=n, trial=trial)
        A = blocky_tensor(n, torch.float16, s)
        static_A.copy_(A)
        gq.replay()
        want_p, want_a = formats.quantize_reference(A, cb.cpu(), k, one.cpu())
        assert_bits_equal(qp, want_p, f"packed {msg}")
        assert_bits_equal(qa, want_a, f"absmax {msg}")
        p, a = random_storage(n, k, s)
        static_p.copy_(p)
        static_a.copy_(a)
        gd.replay()
        assert_bits_equal(deq, formats.dequantize_reference(p, a, cb.cpu(), k, n, torch.bfloat16, one.cpu()), msg)


# ----------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
def test_torch_compile_matmul(dtype):
    seed = seed_for("compile", dtype)
    g = gen(seed + 1, "cuda")
    N, K, k = 512, 1024, 4
    qw = quantized_weight(N, K, k, seed)
    bias = torch.randn(N, generator=g, device="cuda").to(dtype)

    def f(x):
        return kbit.matmul(x * 2, qw, bias) * 0.5  # exact scalings: compiled == eager bit for bit

    cf = torch.compile(f, fullgraph=True)
    for M in (1, 16):
        x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
        assert_bits_equal(cf(x), f(x), tag(seed, op="compile-matmul", dtype=dtype, M=M))


def test_torch_compile_kbit_linear():
    KbitLinear = getattr(kbit, "KbitLinear", None)
    if KbitLinear is None:
        KbitLinear = getattr(pytest.importorskip("kbit.nn"), "KbitLinear", None)
    if KbitLinear is None:
        pytest.skip("kbit.KbitLinear is not available")
    seed = seed_for("compile-linear")
    torch.manual_seed(seed)
    dense = torch.nn.Sequential(
        torch.nn.Linear(256, 512, bias=True), torch.nn.SiLU(), torch.nn.Linear(512, 136, bias=False)
    ).to(device="cuda", dtype=torch.float16)
    with torch.no_grad():
        model = torch.nn.Sequential(KbitLinear.from_linear(dense[0], bits=4), torch.nn.SiLU(),
                                    KbitLinear.from_linear(dense[2], bits=3)).cuda()
        x = torch.randn(3, 5, 256, device="cuda", dtype=torch.float16)
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    msg = tag(seed, op="compile-KbitLinear")
    assert compiled.shape == (3, 5, 136) and compiled.dtype == torch.float16 and compiled.is_cuda, msg
    assert_no_nan(compiled, msg)
    # Inductor may fuse SiLU differently (an ulp); the GEMMs are the same kernel.
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2 * float(eager.abs().max()), msg=msg)
