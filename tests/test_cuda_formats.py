"""kbit::quantize, kbit::dequantize and kbit::repack on CUDA: bit-exact against kbit.formats / kbit.layout
(conventions: tests/cuda_harness.py)."""

from __future__ import annotations

import math

import pytest
import torch

import kbit
import kbit.functional
from kbit import formats, layout, ops
from cuda_harness import (assert_bits_equal, assert_no_nan, BITS, blocky_tensor, FLOAT_DTYPES, gen, make_codebook,
    _name, poison, poisoned, random_storage, seed_for, SIZES, tag)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
    pytest.mark.usefixtures("ieee_fp32_matmul"),  # fp32 references are real fp32 products (conftest.py)
]


# ----------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("cb_kind", ["nf", "custom"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_name)
@pytest.mark.parametrize("k", BITS)
def test_quantize_bit_exact(k, dtype, n, cb_kind):
    seed = seed_for("quantize", k, dtype, n, cb_kind)
    msg = tag(seed, op="quantize", bits=k, dtype=dtype, n=n, codebook=cb_kind)
    A = blocky_tensor(n, dtype, seed)
    cb = make_codebook(k, cb_kind, seed)
    scale = torch.ones((), dtype=torch.float32)
    want_p, want_a = formats.quantize_reference(A, cb, k, scale)
    A_c, cb_c, s_c = A.cuda(), cb.cuda(), scale.cuda()
    nb = formats.block_count(n)
    for byte in (0xFF, 0x00):
        ptrs = poison((nb * k, torch.int32), (nb, torch.uint8), byte=byte)
        got_p, got_a = ops.quantize(A_c, cb_c, k, s_c)
        poisoned(ptrs, got_p, got_a)
        assert_bits_equal(got_a, want_a, f"absmax {msg} poison={byte:#x}")
        assert_bits_equal(got_p, want_p, f"packed {msg} poison={byte:#x}")


@pytest.mark.parametrize("cb_kind", ["nf", "custom"])
@pytest.mark.parametrize("k", BITS)
def test_quantize_midpoint_ties(k, cb_kind):
    """Values exactly on codebook entries and midpoints (power-of-two block absmax makes the
    scaled value exact): ties must go to the lower entry, as in the reference."""
    seed = seed_for("ties", k, cb_kind)
    msg = tag(seed, op="quantize-ties", bits=k, codebook=cb_kind)
    g = gen(seed)
    cb = make_codebook(k, cb_kind, seed)
    mids = (cb[1:] + cb[:-1]) * 0.5
    cand = torch.cat([cb, mids, -mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                      torch.nextafter(mids, torch.full_like(mids, -2.0)), torch.zeros(1)]).clamp(-1, 1)
    nb = 4096
    e = torch.randint(-10, 5, (nb,), generator=g).to(torch.float32)
    idx = torch.randint(0, cand.numel(), (nb, 32), generator=g)
    x = cand[idx]
    x[:, torch.randint(0, 32, (1,), generator=g).item()] = 1.0  # block absmax exactly 2**e
    x = (x * torch.exp2(e)[:, None]).reshape(-1)
    for dtype in FLOAT_DTYPES:
        A = x.to(dtype)
        scale = torch.ones(())
        want_p, want_a = formats.quantize_reference(A, cb, k, scale)
        A_c, cb_c, s_c = A.cuda(), cb.cuda(), scale.cuda()
        poison((nb * k, torch.int32), (nb, torch.uint8))
        got_p, got_a = ops.quantize(A_c, cb_c, k, s_c)
        assert_bits_equal(got_a, want_a, f"absmax {msg} dtype={_name(dtype)}")
        assert_bits_equal(got_p, want_p, f"packed {msg} dtype={_name(dtype)}")


@pytest.mark.parametrize("factor", [1000.0, 1e-5, 1.0])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_name)
@pytest.mark.parametrize("k", BITS)
def test_quantize_tensor_scale_matches_cpu(k, dtype, factor):
    """kbit.quantize picks a per-tensor power-of-two scale; CUDA and CPU agree bit for bit."""
    seed = seed_for("scale", k, dtype, factor)
    msg = tag(seed, op="kbit.quantize", bits=k, dtype=dtype, factor=factor)
    W = (torch.randn(96, 200, generator=gen(seed)) * factor).to(dtype)  # K = 200: padded to 224
    q_cpu = kbit.quantize(W, k)
    q_gpu = kbit.quantize(W.cuda(), k)
    assert_bits_equal(q_gpu.scale, q_cpu.scale, f"scale {msg}")
    assert_bits_equal(q_gpu.absmax, q_cpu.absmax, f"absmax {msg}")
    assert_bits_equal(q_gpu.packed, q_cpu.packed, f"packed {msg}")
    for out_dtype in FLOAT_DTYPES:
        assert_bits_equal(kbit.dequantize(q_gpu, out_dtype), kbit.dequantize(q_cpu, out_dtype),
                          f"dequantize {msg} out={_name(out_dtype)}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("log2_scale", [-20, -3, 6])
@pytest.mark.parametrize("k", BITS)
def test_quantize_op_with_scale(k, log2_scale, dtype):
    seed = seed_for("opscale", k, log2_scale, dtype)
    msg = tag(seed, op="quantize", bits=k, dtype=dtype, scale=f"2**{log2_scale}")
    n = 8192 + 45
    A = (blocky_tensor(n, torch.float32, seed) * 2.0**log2_scale).to(dtype)
    cb = make_codebook(k, "nf", seed)
    scale = torch.tensor(2.0**log2_scale)
    want_p, want_a = formats.quantize_reference(A, cb, k, scale)
    A_c, cb_c, s_c = A.cuda(), cb.cuda(), scale.cuda()
    nb = formats.block_count(n)
    poison((nb * k, torch.int32), (nb, torch.uint8))
    got_p, got_a = ops.quantize(A_c, cb_c, k, s_c)
    assert_bits_equal(got_a, want_a, f"absmax {msg}")
    assert_bits_equal(got_p, want_p, f"packed {msg}")


# ----------------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("cb_kind", ["nf", "custom"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_name)
@pytest.mark.parametrize("k", BITS)
def test_dequantize_bit_exact(k, dtype, n, cb_kind):
    seed = seed_for("dequantize", k, dtype, n, cb_kind)
    packed, absmax = random_storage(n, k, seed)
    cb = make_codebook(k, cb_kind, seed)
    p_c, a_c, cb_c = packed.cuda(), absmax.cuda(), cb.cuda()
    for log2_scale in (0, -7, 3 if dtype == torch.float16 else 20):
        msg = tag(seed, op="dequantize", bits=k, dtype=dtype, n=n, codebook=cb_kind, scale=f"2**{log2_scale}")
        scale = torch.tensor(2.0**log2_scale)
        want = formats.dequantize_reference(packed, absmax, cb, k, n, dtype, scale)
        s_c = scale.cuda()
        ptrs = poison((n, dtype))
        got = ops.dequantize(p_c, a_c, cb_c, k, n, dtype, s_c)
        poisoned(ptrs, got)
        assert_no_nan(got, msg)
        assert_bits_equal(got, want, msg)


def test_empty_inputs():
    """Zero-element inputs must not launch an empty grid (invalid configuration)."""
    for k in BITS:
        cb = kbit.functional.create_normal_float_codebook(k, device="cuda")
        one = torch.ones((), device="cuda")
        p, a = ops.quantize(torch.empty(0, dtype=torch.float16, device="cuda"), cb, k, one)
        assert p.shape == (0,) and a.shape == (0,) and p.is_cuda
        for dtype in FLOAT_DTYPES:
            w = ops.dequantize(p, a, cb, k, 0, dtype, one)
            assert w.shape == (0,) and w.dtype == dtype
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- repack
REPACK_SHAPES = ((128, 32), (128, 96), (256, 256), (1000, 96), (1000, 4096), (128, 11008), (4096, 32), (4096, 256),
                 (256, 4096), (4096, 4096), (1000, 11008))


@pytest.mark.parametrize("N,in_features_padded", REPACK_SHAPES)
@pytest.mark.parametrize("k", BITS)
def test_repack_bit_exact(k, N, in_features_padded):
    seed = seed_for("repack", k, N, in_features_padded)
    msg = tag(seed, op="repack", bits=k, N=N, in_features_padded=in_features_padded)
    packed, absmax = random_storage(N * in_features_padded, k, seed)
    p_c, a_c = packed.cuda(), absmax.cuda()
    if N * in_features_padded <= (1 << 20):
        want_b, want_a = layout.repack_reference(packed, absmax, k, N, in_features_padded)
    else:  # the same pure-integer reference, run on the GPU for speed
        want_b, want_a = layout.repack_reference(p_c, a_c, k, N, in_features_padded)
    b_shape, a_shape = layout.gemm_shapes(k, N, in_features_padded)
    ptrs = poison((math.prod(b_shape), torch.int32), (math.prod(a_shape), torch.uint8))
    got_b, got_a = ops.repack(p_c, a_c, k, N, in_features_padded)
    poisoned(ptrs, got_b, got_a)
    assert got_b.is_contiguous() and got_a.is_contiguous(), msg
    assert_bits_equal(got_a, want_a, f"absmax_gemm {msg}")
    assert_bits_equal(got_b, want_b, f"B_gemm {msg}")
    back_p, back_a = ops.unrepack(got_b, got_a, k, N, in_features_padded)
    assert_bits_equal(back_p, p_c, f"unrepack(repack(x)).packed {msg}")
    assert_bits_equal(back_a, a_c, f"unrepack(repack(x)).absmax {msg}")


DEQUANTIZE_LAYOUT_SHAPES = ((128, 32), (1000, 96), (1000, 4096), (128, 11008), (4096, 256), (4096, 4096))


@pytest.mark.parametrize("N,in_features_padded", DEQUANTIZE_LAYOUT_SHAPES)
@pytest.mark.parametrize("k", BITS)
def test_dequantize_layout_bit_exact(k, N, in_features_padded):
    """The dense weight straight from the GEMM layout: dequantize of the storage it holds, bit for bit, in every
    dtype, on arbitrary codes and E4M4 bytes, a custom codebook and scale; the output poisoned first."""
    seed = seed_for("dequantize_layout", k, N, in_features_padded)
    msg = tag(seed, op="dequantize_layout", bits=k, N=N, in_features_padded=in_features_padded)
    packed, absmax = (t.cuda() for t in random_storage(N * in_features_padded, k, seed))
    cb = make_codebook(k, "custom", seed).cuda()
    scale = torch.tensor(0.5 + torch.rand((), generator=gen(seed + 3)).item(), device="cuda")
    b, a = ops.repack(packed, absmax, k, N, in_features_padded)
    for dtype in FLOAT_DTYPES:
        want = ops.dequantize(packed, absmax, cb, k, N * in_features_padded, dtype, scale)
        ptrs = poison((N * in_features_padded, dtype))
        got = ops.dequantize_layout(b, a, cb, k, N, in_features_padded, dtype, scale)
        poisoned(ptrs, got)
        assert got.shape == (N, in_features_padded) and got.dtype == dtype and got.is_contiguous(), msg
        assert_bits_equal(got.reshape(-1), want, f"{dtype} {msg}")
