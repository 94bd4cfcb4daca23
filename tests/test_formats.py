"""The storage format: codebook, E4M4, bit planes, quantize_kbit / dequantize_kbit, error bounds."""

from __future__ import annotations

import math

import pytest
import torch

import kbit
import kbit.functional
from kbit import formats

KS = (2, 3, 4, 5)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SQNR_DB = {2: 5.0, 3: 10.0, 4: 15.0, 5: 20.0}
EPS = 1e-6


def _name(d):
    return str(d).replace("torch.", "")


def block_view(x: torch.Tensor) -> torch.Tensor:
    """Flatten and zero-pad to [blocks, 32] in float32."""
    x = x.reshape(-1).to(torch.float32)
    nb = formats.block_count(x.numel())
    return torch.nn.functional.pad(x, (0, nb * 32 - x.numel())).reshape(nb, 32)


def assert_block_bound(A, A_hat, codebook, eps_abs=0.0, what="", support=(-1.0, 1.0)):
    """The seeds' bound: per block, max|A - A_hat| <= (max_gap/2 + 1/16) * absmax + eps.

    ``max_gap / 2`` is the codebook's covering radius over ``support`` (the range of x / absmax);
    for a codebook spanning [-1, 1] it is exactly half the largest gap, as in the seeds.
    """
    a, b = block_view(A), block_view(A_hat)
    cb = codebook.to(torch.float32)
    lo, hi = support
    max_gap = max(float((cb[1:] - cb[:-1]).max()), 2 * (float(cb[0]) - lo), 2 * (hi - float(cb[-1])))
    absmax = a.abs().amax(dim=1)
    err = (a - b).abs().amax(dim=1)
    bound = (max_gap / 2 + 1 / 16) * absmax + EPS * absmax + eps_abs
    bad = err > bound
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} blocks exceed the error bound; block {i}: "
            f"err={float(err[i]):.6g} bound={float(bound[i]):.6g} absmax={float(absmax[i]):.6g} max_gap={max_gap:.4f}"
        )


def sqnr_db(A, A_hat) -> float:
    a, b = A.to(torch.float64), A_hat.to(torch.float64)
    return 10 * math.log10(float((a * a).sum()) / float(((a - b) ** 2).sum()))


def nearest_entry_violations(A, packed, absmax, codebook, k, scale=1.0):
    """Count elements whose code is not (one of) the nearest codebook entries to x / block absmax."""
    a = block_view(A) / scale
    dec = kbit.functional.decode_absmax_e4m4(absmax)
    v = torch.where(dec[:, None] > 0, a / torch.where(dec > 0, dec, torch.ones_like(dec))[:, None], torch.zeros_like(a))
    codes = formats.unpack_bitplanes(packed, k)
    cb = codebook.to(torch.float32)
    dist_chosen = (v - cb[codes]).abs()
    dist_best = (v[..., None] - cb).abs().amin(dim=-1)
    return int((dist_chosen > dist_best + 1e-6 * (1 + v.abs())).sum())


# ----------------------------------------------------------------------------- codebook
@pytest.mark.parametrize("k", KS)
def test_codebook_properties(k):
    cb = kbit.functional.create_normal_float_codebook(k)
    assert cb.dtype == torch.float32 and cb.shape == (2**k,)
    assert bool((cb[1:] > cb[:-1]).all()), "codebook must be strictly ascending"
    assert float(cb.abs().max()) == 1.0
    assert float(cb[0]) == -1.0 and float(cb[-1]) == 1.0
    torch.testing.assert_close(cb, -cb.flip(0), rtol=0, atol=1e-7)  # symmetric, no zero entry
    assert not bool((cb == 0).any())


@pytest.mark.parametrize("k", KS)
def test_codebook_matches_numerical_integration(k):
    # Independent check: E[X | X in bin] for 2**k equiprobable bins of N(0, 1), by quadrature.
    n = 2**k
    x = torch.linspace(-12, 12, 2_400_001, dtype=torch.float64)
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    cdf = torch.cumsum(pdf, 0) * (x[1] - x[0])
    bins = torch.clamp((cdf * n).floor().long(), max=n - 1)
    mass = torch.zeros(n, dtype=torch.float64).index_add_(0, bins, pdf)
    first = torch.zeros(n, dtype=torch.float64).index_add_(0, bins, pdf * x)
    means = first / mass
    expected = (means / means.abs().max()).to(torch.float32)
    # fp16-exact levels: within half an fp16 step (2^-12 at |v| < 1) of the integrals
    cb = kbit.functional.create_normal_float_codebook(k)
    torch.testing.assert_close(cb, expected, rtol=0, atol=2.0**-12 + 1e-5)  # + the quadrature's own error
    assert torch.equal(cb.half().float(), cb)


def test_codebook_known_values_k2():
    # Quartile bins: E[X | X > z.75] = phi(z.75) / 0.25, E[X | 0 < X < z.75] = (phi(0) - phi(z.75)) / 0.25.
    z = 0.6744897501960817
    phi = lambda t: math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)  # noqa: E731
    inner = (phi(0) - phi(z)) / phi(z)
    expected = torch.tensor([-1.0, -inner, inner, 1.0]).half().float()
    torch.testing.assert_close(kbit.functional.create_normal_float_codebook(2), expected, rtol=0, atol=0)


def test_codebook_cached_and_safe_to_mutate():
    formats._normal_float_codebook_cpu.cache_clear()
    a = kbit.functional.create_normal_float_codebook(4)
    a.fill_(7.0)  # a caller mutating its copy must not corrupt the cache
    b = kbit.functional.create_normal_float_codebook(4)
    assert float(b.abs().max()) == 1.0
    info = formats._normal_float_codebook_cpu.cache_info()
    assert info.misses == 1 and info.hits >= 1
    assert kbit.functional.create_normal_float_codebook(4, device="meta").device.type == "meta"
    c = kbit.functional.create_normal_float_codebook(4, device="cpu")  # same device: still a copy
    c.fill_(7.0)
    assert float(kbit.functional.create_normal_float_codebook(4).abs().max()) == 1.0


def test_codebook_cache_outlives_a_meta_device_context():
    """transformers builds empty models under torch.device("meta"): a first call there must not cache a meta
    codebook that every later quantization would then get."""
    formats._normal_float_codebook_cpu.cache_clear()
    with torch.device("meta"):
        inside = kbit.functional.create_normal_float_codebook(3)
    assert inside.device.type == "cpu"
    torch.testing.assert_close(kbit.functional.create_normal_float_codebook(3), inside, rtol=0, atol=0)


@pytest.mark.parametrize("k", [0, 1, 6, 8, -4])
def test_codebook_bad_k(k):
    with pytest.raises(ValueError, match="bits must be one of"):
        kbit.functional.create_normal_float_codebook(k)
    with pytest.raises(TypeError, match="bits must be an int"):
        kbit.functional.create_normal_float_codebook(4.0)


# ----------------------------------------------------------------------------- E4M4
def all_codes():
    return torch.arange(256, dtype=torch.int32).to(torch.uint8)


def test_e4m4_decode_known_values():
    dec = kbit.functional.decode_absmax_e4m4(all_codes())
    assert dec.dtype == torch.float32
    assert float(dec[0]) == 0.0
    assert float(dec[1]) == 2.0**-14  # smallest subnormal
    assert float(dec[0x0F]) == 15 * 2.0**-14  # largest subnormal
    assert float(dec[0x10]) == 2.0**-10  # smallest normal
    assert float(dec[11 << 4]) == 1.0  # bias 11
    assert float(dec[(11 << 4) | 8]) == 1.5
    assert float(dec[0xFF]) == 31.0
    # Independent formula for every code.
    for c in range(256):
        e, m = c >> 4, c & 0xF
        want = m * 2.0**-14 if e == 0 else 2.0 ** (e - 11) * (1 + m / 16)
        assert float(dec[c]) == want, f"code {c:#04x}: got {float(dec[c])}, want {want}"


def test_e4m4_code_shifted_into_fp16_is_a_sixteenth():
    # The GEMM kernel's decode (e4m4_pair_bits, common.cuh): a code at bits 6..13 of an fp16 bit pattern is exactly
    # 1/16 of its E4M4 value, subnormals included; the kernel multiplies its output by 16, or where it scales the
    # weights in 16 bits (GemmConfig::kScaleWeights) its lookup table holds the codebook times 16.
    codes = all_codes()
    as_fp16 = (codes.to(torch.int32) << 6).to(torch.int16).view(torch.float16).float()
    assert torch.equal(as_fp16 * 16, kbit.functional.decode_absmax_e4m4(codes))


def test_e4m4_code_shifted_into_bf16_is_its_value_times_2_to_the_minus_116():
    # The same decode for bf16 weights (e4m4_pair_bits<__nv_bfloat16>): a code at bits 3..10 of a bf16 bit pattern
    # (exponent field from bit 7, as fp32's) is exactly its E4M4 value times 2^-116, exponent 0 as bf16 subnormals;
    # the lookup table holds the codebook times 2^116.
    codes = all_codes()
    as_bf16 = (codes.to(torch.int32) << 3).to(torch.int16).view(torch.bfloat16).double()
    assert torch.equal(as_bf16 * 2.0**116, kbit.functional.decode_absmax_e4m4(codes).double())


@pytest.mark.parametrize("k", (2, 3, 4, 5))
def test_weights_scaled_in_16_bits_are_the_16_bit_code_value_times_the_scale_rounded_once(k):
    # mma.sync at 16 and 32 tokens per pass (GemmConfig::kScaleWeights, gemm.cuh): the table holds the codebook over
    # the decode's unit (16 for fp16, 2^116 for bf16), the decode the code shifted into the type (value x unit), and
    # one 16-bit multiply (exact product, rounded once) gives round(codebook value in T x scale) for every code value
    # and every E4M4 scale, subnormal results included: the weight the wgmma path and the reference's dequantize make.
    codes = all_codes()
    scales = kbit.functional.decode_absmax_e4m4(codes).double()
    codebook = kbit.functional.create_normal_float_codebook(k).double()
    for dtype, shift, unit in ((torch.float16, 6, 2.0**-4), (torch.bfloat16, 3, 2.0**-116)):
        table = (codebook / unit).to(dtype).double()
        decoded = (codes.to(torch.int32) << shift).to(torch.int16).view(dtype).double()
        got = (table[:, None] * decoded[None, :]).to(dtype)
        want = (codebook.to(dtype).double()[:, None] * scales[None, :]).to(dtype)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), dtype


def test_e4m4_round_trip_all_codes():
    codes = all_codes()
    assert torch.equal(kbit.functional.encode_absmax_e4m4(kbit.functional.decode_absmax_e4m4(codes)), codes)


def test_e4m4_monotone_and_unique():
    dec = kbit.functional.decode_absmax_e4m4(all_codes())
    assert bool((dec[1:] > dec[:-1]).all()), "decoded values must be strictly increasing in the code"
    assert torch.unique(dec).numel() == 256
    x = torch.sort(torch.exp2(torch.empty(200_000).uniform_(-18, 5.2)))[0]
    enc = kbit.functional.encode_absmax_e4m4(x).to(torch.int32)
    assert bool((enc[1:] >= enc[:-1]).all()), "encoding must be monotone"


def test_e4m4_subnormals():
    m = torch.arange(16, dtype=torch.float32)
    assert torch.equal(kbit.functional.decode_absmax_e4m4(torch.arange(16, dtype=torch.uint8)), m * 2.0**-14)
    # Random values in the subnormal range round to the nearest multiple of 2**-14.
    x = torch.rand(10_000) * 2.0**-10
    code = kbit.functional.encode_absmax_e4m4(x)
    err = (kbit.functional.decode_absmax_e4m4(code) - x).abs()
    assert float(err.max()) <= 2.0**-15 * (1 + 1e-6)
    # Below half the smallest subnormal, a value rounds to zero.
    assert int(kbit.functional.encode_absmax_e4m4(torch.tensor([2.0**-16]))[0]) == 0


def test_e4m4_rounds_to_nearest():
    table = kbit.functional.decode_absmax_e4m4(all_codes()).to(torch.float64)
    x = torch.cat([torch.exp2(torch.empty(50_000).uniform_(-16, 4.95)), torch.rand(20_000) * 31, torch.tensor([31.0])])
    dec = kbit.functional.decode_absmax_e4m4(kbit.functional.encode_absmax_e4m4(x)).to(torch.float64)
    best = (x.to(torch.float64)[:, None] - table).abs().amin(dim=1)
    err = (dec - x.to(torch.float64)).abs()
    bad = err > best
    assert not bool(bad.any()), f"not nearest for x={x[bad][:5].tolist()}"
    # Relative error of normal values is at most half a mantissa step: 1/32.
    normal = x >= 2.0**-10
    rel = err[normal] / x[normal].to(torch.float64)
    assert float(rel.max()) <= 1 / 32 + 1e-9


def test_e4m4_ties_to_even():
    table = kbit.functional.decode_absmax_e4m4(all_codes())
    for c in range(0x10, 0xFF):
        if (c & 0xF) == 0xF:
            continue  # the next code has the next exponent: the midpoint is not a tie in mantissa bits
        mid = (table[c] + table[c + 1]) / 2
        got = int(kbit.functional.encode_absmax_e4m4(mid.reshape(1))[0])
        want = c if (c & 1) == 0 else c + 1
        assert got == want, f"midpoint between codes {c:#04x} and {c + 1:#04x} encoded as {got:#04x}"


def test_e4m4_saturates_and_rejects_bad_values():
    assert int(kbit.functional.encode_absmax_e4m4(torch.tensor([1e6]))[0]) == 0xFF
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite, non-negative"):
            kbit.functional.encode_absmax_e4m4(torch.tensor([1.0, bad]))
    with pytest.raises(TypeError, match="uint8"):
        kbit.functional.decode_absmax_e4m4(torch.tensor([1, 2], dtype=torch.int32))


# ----------------------------------------------------------------------------- bit planes
@pytest.mark.parametrize("k", KS)
def test_pack_unpack_round_trip(k):
    nb = int(torch.randint(1, 3000, ()))
    codes = torch.randint(0, 2**k, (nb, 32))
    packed = formats.pack_bitplanes(codes, k)
    assert packed.dtype == torch.int32 and packed.shape == (nb * k,)
    assert torch.equal(formats.unpack_bitplanes(packed, k), codes), f"nb={nb}"
    # And the other way: any int32 words are a valid packing.
    words = torch.randint(-(2**31), 2**31, (nb * k,), dtype=torch.int64).to(torch.int32)
    assert torch.equal(formats.pack_bitplanes(formats.unpack_bitplanes(words, k), k), words)


@pytest.mark.parametrize("k", KS)
def test_pack_layout_bit_by_bit(k):
    # Word i*k + b holds bit b of the codes of elements 32*i .. 32*i+31, element j at bit j.
    nb = 5
    codes = torch.randint(0, 2**k, (nb, 32))
    packed = formats.pack_bitplanes(codes, k).tolist()
    for i in range(nb):
        for b in range(k):
            word = packed[i * k + b] & 0xFFFFFFFF
            want = sum(((int(codes[i, j]) >> b) & 1) << j for j in range(32))
            assert word == want, f"block {i} plane {b}"


@pytest.mark.parametrize("k", KS)
def test_quantize_kbit_exact_codes_and_layout(k):
    # Inputs that are exactly codebook entries (with the block absmax 1.0 present) must get exactly
    # those codes, packed in the seeds' bit-plane layout.
    cb = kbit.functional.create_normal_float_codebook(k)
    nb = 7
    codes = torch.randint(0, 2**k, (nb, 32))
    codes[:, 0] = 2**k - 1  # absmax 1.0 in every block
    A = cb[codes].reshape(-1)
    packed, absmax, cb_out = kbit.functional.quantize_kbit(A, k)
    assert torch.equal(cb_out, cb)
    assert torch.equal(absmax, torch.full((nb,), 11 << 4, dtype=torch.uint8))  # E4M4 of 1.0
    words = packed.tolist()
    for i in range(nb):
        for b in range(k):
            want = sum(((int(codes[i, j]) >> b) & 1) << j for j in range(32))
            assert words[i * k + b] & 0xFFFFFFFF == want
    assert torch.equal(kbit.functional.dequantize_kbit(packed, absmax, cb, k, A.numel(), torch.float32), A)


# ----------------------------------------------------------------------------- quantize / dequantize
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_error_bound_and_sqnr_1m(k, dtype):
    n = (1 << 20) + int(torch.randint(1, 32, ()))  # 1M+ elements, last block padded
    A = torch.randn(n).to(dtype)
    packed, absmax, cb = kbit.functional.quantize_kbit(A, k)
    nb = formats.block_count(n)
    assert packed.shape == (nb * k,) and packed.dtype == torch.int32
    assert absmax.shape == (nb,) and absmax.dtype == torch.uint8
    A_hat = kbit.functional.dequantize_kbit(packed, absmax, cb, k, n, torch.float32)
    assert A_hat.shape == (n,) and A_hat.dtype == torch.float32
    assert_block_bound(A, A_hat, cb, what=f"bits={k} dtype={_name(dtype)} n={n}")
    s = sqnr_db(A.float(), A_hat)
    assert s > SQNR_DB[k], f"bits={k} dtype={_name(dtype)}: SQNR {s:.2f} dB <= {SQNR_DB[k]} dB"
    assert nearest_entry_violations(A, packed, absmax, cb, k) == 0


@pytest.mark.parametrize("k", KS)
def test_sqnr_increases_with_k(k):
    A = torch.randn(1 << 16)
    s = {kk: sqnr_db(A, kbit.functional.dequantize_kbit(*kbit.functional.quantize_kbit(A, kk), kk, A.numel(), torch.float32)) for kk in KS}
    assert all(s[a] < s[b] for a, b in zip(KS, KS[1:])), s


@pytest.mark.parametrize("in_dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=_name)
def test_output_dtypes(in_dtype, out_dtype):
    k = int(torch.randint(2, 6, ()))
    n = int(torch.randint(1, 5000, ()))
    A = torch.randn(n).to(in_dtype)
    packed, absmax, cb = kbit.functional.quantize_kbit(A, k)
    ref = kbit.functional.dequantize_kbit(packed, absmax, cb, k, n, torch.float32)
    out = kbit.functional.dequantize_kbit(packed, absmax, cb, k, n, out_dtype)
    assert out.dtype == out_dtype and out.shape == (n,)
    assert torch.equal(out, ref.to(out_dtype)), f"bits={k} n={n}: dequantize in {out_dtype} != fp32 result rounded"


@pytest.mark.parametrize("n", [1, 31, 32, 33, 63, 64, 65, 1000, 4097])
def test_any_number_of_elements(n):
    k = int(torch.randint(2, 6, ()))
    A = torch.randn(n)
    packed, absmax, cb = kbit.functional.quantize_kbit(A, k)
    nb = formats.block_count(n)
    assert packed.numel() == nb * k and absmax.numel() == nb
    A_hat = kbit.functional.dequantize_kbit(packed, absmax, cb, k, n, torch.float32)
    assert A_hat.shape == (n,)
    assert_block_bound(A, A_hat, cb, what=f"bits={k} n={n}")


def test_multidimensional_input_is_flattened():
    A = torch.randn(3, 5, 7)
    packed, absmax, cb = kbit.functional.quantize_kbit(A, 4)
    p2, a2, _ = kbit.functional.quantize_kbit(A.reshape(-1), 4)
    assert torch.equal(packed, p2) and torch.equal(absmax, a2)
    # Non-contiguous input quantizes its logical (row-major) order.
    B = torch.randn(64, 48)
    p3, a3, _ = kbit.functional.quantize_kbit(B.T, 3)
    p4, a4, _ = kbit.functional.quantize_kbit(B.T.contiguous(), 3)
    assert torch.equal(p3, p4) and torch.equal(a3, a4)


def test_zeros_and_empty():
    packed, absmax, cb = kbit.functional.quantize_kbit(torch.zeros(100), 4)
    assert bool((absmax == 0).all())
    assert bool((kbit.functional.dequantize_kbit(packed, absmax, cb, 4, 100, torch.float32) == 0).all())
    packed, absmax, cb = kbit.functional.quantize_kbit(torch.zeros(0), 3)
    assert packed.numel() == 0 and absmax.numel() == 0
    assert kbit.functional.dequantize_kbit(packed, absmax, cb, 3, 0, torch.float16).shape == (0,)


# ----------------------------------------------------------------------------- custom codebooks
def _custom_codebooks(k):
    n = 2**k
    u = torch.linspace(0, 1, n)
    return {
        "uniform": torch.linspace(-1, 1, n),
        "all_positive": u * 0.9 + 0.1,  # 0.1 .. 1
        "all_negative": -(u * 0.9 + 0.1).flip(0),  # -1 .. -0.1
        "skewed": 2 * u**2 - 1,  # dense near -1, sparse near 1
        "non_uniform": torch.sign(torch.linspace(-1, 1, n)) * torch.linspace(-1, 1, n).abs() ** 3,
    }


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("name", ["uniform", "all_positive", "all_negative", "skewed", "non_uniform"])
def test_custom_codebook(k, name):
    cb = _custom_codebooks(k)[name]
    n = int(torch.randint(10_000, 50_000, ()))
    # Data that matches the codebook's support, so the seeds' error bound applies.
    A = torch.randn(n)
    if name == "all_positive":
        A = A.abs()
    elif name == "all_negative":
        A = -A.abs()
    packed, absmax, cb_out = kbit.functional.quantize_kbit(A, k, codebook=cb)
    torch.testing.assert_close(cb_out, cb, rtol=0, atol=0)
    A_hat = kbit.functional.dequantize_kbit(packed, absmax, cb_out, k, n, torch.float32)
    assert nearest_entry_violations(A, packed, absmax, cb, k) == 0, f"{name} bits={k} n={n}"
    # Every reconstructed value is a codebook entry times its block scale.
    scales = kbit.functional.decode_absmax_e4m4(absmax)
    codes = formats.unpack_bitplanes(packed, k)
    expected = (cb[codes] * scales[:, None]).reshape(-1)[:n]
    torch.testing.assert_close(A_hat, expected, rtol=0, atol=0)
    support = {"all_positive": (0.0, 1.0), "all_negative": (-1.0, 0.0)}.get(name, (-1.0, 1.0))
    assert_block_bound(A, A_hat, cb, what=f"{name} bits={k} n={n}", support=support)


@pytest.mark.parametrize("k", KS)
def test_asymmetric_codebook_with_mismatched_data(k):
    # An all-positive codebook on signed data: every negative value goes to the smallest entry
    # (the nearest one), never to anything else.
    cb = _custom_codebooks(k)["all_positive"]
    A = torch.randn(20_000)
    packed, absmax, _ = kbit.functional.quantize_kbit(A, k, codebook=cb)
    codes = formats.unpack_bitplanes(packed, k).reshape(-1)[: A.numel()]
    assert bool((codes[A < 0] == 0).all())
    assert nearest_entry_violations(A, packed, absmax, cb, k) == 0


def test_codebook_dtype_and_device_normalized():
    cb = torch.linspace(-1, 1, 16, dtype=torch.float16)
    _, _, out = kbit.functional.quantize_kbit(torch.randn(100), 4, codebook=cb)
    assert out.dtype == torch.float32


# ----------------------------------------------------------------------------- out-of-range absmax
@pytest.mark.parametrize("factor", [1000.0, 1e-5])
@pytest.mark.parametrize("k", KS)
def test_out_of_range_absmax_needs_scale(factor, k):
    W = torch.randn(1024, 1024) * factor
    with pytest.raises(ValueError, match=r"E4M4.*scale"):
        kbit.functional.quantize_kbit(W, k)
    qw = kbit.quantize(W, bits=k)  # picks a per-tensor power-of-two scale
    s = float(qw.scale)
    assert s > 0 and math.frexp(s)[0] == 0.5, f"scale {s} is not a power of two"
    W_hat = kbit.dequantize(qw)
    assert_block_bound(W, W_hat, qw.codebook, eps_abs=EPS * float(W.abs().max()), what=f"factor={factor} bits={k}")
    assert sqnr_db(W, W_hat) > SQNR_DB[k]
    # The low-level API with the same explicit scale reproduces the stored format bit for bit.
    packed, absmax, _ = kbit.functional.quantize_kbit(W, k, scale=qw.scale)
    assert torch.equal(packed, qw.packed) and torch.equal(absmax, qw.absmax)
    flat = kbit.functional.dequantize_kbit(packed, absmax, qw.codebook, k, W.numel(), torch.float32, scale=qw.scale)
    assert torch.equal(flat.reshape(W.shape), W_hat)


@pytest.mark.parametrize("factor", [1e30, 1e-30, 1e-38, 3e4])
def test_extreme_magnitudes_fp32(factor):
    W = torch.randn(64, 96) * factor
    qw = kbit.quantize(W, bits=4)
    W_hat = kbit.dequantize(qw)
    assert bool(torch.isfinite(W_hat).all())
    assert_block_bound(W, W_hat, qw.codebook, eps_abs=1e-3 * float(W.abs().max()) if factor < 1e-37 else 0.0,
                       what=f"factor={factor}")


def test_fp16_extremes():
    W = (torch.randn(64, 64) * 5000).to(torch.float16)  # absmax ~2e4, far above E4M4's 31
    qw = kbit.quantize(W, bits=5)
    assert_block_bound(W, kbit.dequantize(qw, torch.float32), qw.codebook, what="fp16 large")
    W = (torch.randn(64, 64) * 1e-6).to(torch.float16)  # fp16 subnormals
    qw = kbit.quantize(W, bits=5)
    assert_block_bound(W, kbit.dequantize(qw, torch.float32), qw.codebook, eps_abs=2.0**-24, what="fp16 tiny")


def test_scale_must_be_power_of_two():
    for bad in (3.0, -2.0, 0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="power of two"):
            kbit.functional.quantize_kbit(torch.randn(64), 4, scale=bad)


def test_choose_tensor_scale():
    for m in (1e-30, 1e-5, 0.3, 1.0, 8.0, 16.0, 17.0, 1000.0, 3e38):
        s = float(formats.choose_tensor_scale(torch.tensor(m)))
        assert math.frexp(s)[0] == 0.5
        assert 8 < m / s <= 16, f"absmax {m} / scale {s} = {m / s} not in (8, 16]"
    assert float(formats.choose_tensor_scale(torch.tensor(0.0))) == 1.0
    # Never a subnormal scale (1 / scale must stay finite).
    s = formats.choose_tensor_scale(torch.tensor(1e-40))
    assert bool(torch.isfinite(1.0 / s)) and float(s) >= 2.0**-126
