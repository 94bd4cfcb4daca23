"""The torch.library ops (opcheck, fake impls), the GEMM layout reference, and torch.compile on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kbit
import kbit.functional
from kbit import formats, layout, ops

from test_formats import KS, _name

LAYOUT_SHAPES = [(1, 32), (17, 96), (100, 288), (130, 64), (200, 544), (256, 256), (128, 800)]


# ----------------------------------------------------------------------------- opcheck
def _storage(k, N, in_features_padded, dtype=torch.float16):
    A = torch.randn(N, in_features_padded).to(dtype)
    cb = kbit.functional.create_normal_float_codebook(k)
    scale = torch.tensor(0.5)
    packed, absmax = ops.quantize(A, cb, k, scale)
    return A, cb, scale, packed, absmax


@pytest.mark.parametrize("k", KS)
def test_opcheck_quantize_dequantize(k):
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        A, cb, scale, packed, absmax = _storage(k, 33, 50, dtype)  # 1650 elements: last block padded
        torch.library.opcheck(ops.quantize, (A, cb, k, scale))
        torch.library.opcheck(ops.dequantize, (packed, absmax, cb, k, A.numel(), dtype, scale))
    torch.library.opcheck(ops.quantize, (torch.randn(0), cb, k, scale))


@pytest.mark.parametrize("k", [k if k == 4 else pytest.param(k, marks=pytest.mark.slow) for k in KS])
def test_opcheck_repack_unrepack_gemm(k):
    N, in_features_padded = 100, 96
    _, cb, scale, packed, absmax = _storage(k, N, in_features_padded)
    torch.library.opcheck(ops.repack, (packed, absmax, k, N, in_features_padded))
    b, a = ops.repack(packed, absmax, k, N, in_features_padded)
    torch.library.opcheck(ops.unrepack, (b, a, k, N, in_features_padded))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        torch.library.opcheck(ops.dequantize_layout, (b, a, cb, k, N, in_features_padded, dtype, scale))
    for M in (0, 1, 5):
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(M, in_features_padded).to(dtype)
            torch.library.opcheck(ops.gemm, (x, b, a, cb, scale, None, k, N, in_features_padded, 0))
            bias = torch.randn(N).to(dtype)
            torch.library.opcheck(ops.gemm, (x, b, a, cb, scale, bias, k, N, in_features_padded, 0))


def test_ops_are_registered_custom_ops():
    for name in ("quantize", "dequantize", "repack", "unrepack", "dequantize_layout", "gemm"):
        op = getattr(torch.ops.kbit, name).default
        assert op.name() == f"kbit::{name}"
    # Fake (meta) implementations give shapes without data.
    A = torch.empty(70, 33, device="meta", dtype=torch.float16)
    cb = torch.empty(16, device="meta")
    s = torch.empty((), device="meta")
    packed, absmax = torch.ops.kbit.quantize(A, cb, 4, s)
    nb = formats.block_count(70 * 33)
    assert packed.shape == (nb * 4,) and packed.dtype == torch.int32 and absmax.shape == (nb,)
    assert torch.ops.kbit.dequantize(packed, absmax, cb, 4, 70 * 33, torch.bfloat16, s).dtype == torch.bfloat16
    p2 = torch.empty(200 * 96 // 32 * 3, device="meta", dtype=torch.int32)
    a2 = torch.empty(200 * 96 // 32, device="meta", dtype=torch.uint8)
    b, a = torch.ops.kbit.repack(p2, a2, 3, 200, 96)
    assert tuple(b.shape) == layout.gemm_shapes(3, 200, 96)[0] and tuple(a.shape) == layout.gemm_shapes(3, 200, 96)[1]
    x = torch.empty(7, 96, device="meta", dtype=torch.float16)
    assert torch.ops.kbit.gemm(x, b, a, cb[:8], s, None, 3, 200, 96, 0).shape == (7, 200)
    w = torch.ops.kbit.dequantize_layout(b, a, cb[:8], 3, 200, 96, torch.bfloat16, s)
    assert w.shape == (200, 96) and w.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- layout
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_repack_round_trip_bit_exact(k, shape):
    N, in_features_padded = shape
    nb = N * in_features_padded // 32
    # Arbitrary bits, not just what quantize produces: repack must be a pure permutation.
    packed = torch.randint(-(2**31), 2**31, (nb * k,), dtype=torch.int64).to(torch.int32)
    absmax = torch.randint(0, 256, (nb,), dtype=torch.int32).to(torch.uint8)
    b, a = layout.repack_reference(packed, absmax, k, N, in_features_padded)
    assert tuple(b.shape) == layout.gemm_shapes(k, N, in_features_padded)[0] and b.dtype == torch.int32
    assert tuple(a.shape) == layout.gemm_shapes(k, N, in_features_padded)[1] and a.dtype == torch.uint8
    p2, a2 = layout.unrepack_reference(b, a, k, N, in_features_padded)
    assert torch.equal(p2, packed), f"bits={k} N={N} in_features_padded={in_features_padded}"
    assert torch.equal(a2, absmax), f"bits={k} N={N} in_features_padded={in_features_padded}"
    # The op wrappers agree with the references.
    b3, a3 = kbit.functional.repack_for_gemm(packed, absmax, k, N, in_features_padded)
    assert torch.equal(b3, b) and torch.equal(a3, a)
    p4, a4 = ops.unrepack(b, a, k, N, in_features_padded)
    assert torch.equal(p4, packed) and torch.equal(a4, absmax)


@pytest.mark.parametrize("k", KS)
def test_dequantize_layout_is_dequantize_of_unrepack(k):
    """The dense weight straight from the GEMM layout equals the storage's dequantize, value for value, on any bits:
    arbitrary codes and E4M4 bytes, rows and k-groups past the padding, every output dtype, the reference and the
    CPU kernel."""
    cb = kbit.functional.create_normal_float_codebook(k)
    scale = torch.tensor(0.375)
    for N, in_features_padded in LAYOUT_SHAPES:
        nb = N * in_features_padded // 32
        packed = torch.randint(-(2**31), 2**31, (nb * k,), dtype=torch.int64).to(torch.int32)
        absmax = torch.randint(0, 256, (nb,), dtype=torch.int32).to(torch.uint8)
        b, a = layout.repack_reference(packed, absmax, k, N, in_features_padded)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            want = formats.dequantize_reference(packed, absmax, cb, k, nb * 32, dtype, scale)
            want = want.reshape(N, in_features_padded)
            bits_view = torch.int32 if dtype == torch.float32 else torch.int16
            for got in (ops.dequantize_layout(b, a, cb, k, N, in_features_padded, dtype, scale),  # the CPU kernel
                        ops.dequantize_layout_reference(b, a, cb, k, N, in_features_padded, dtype, scale)):
                assert got.shape == (N, in_features_padded) and got.dtype == dtype
                assert torch.equal(got.view(bits_view), want.view(bits_view)), \
                    f"bits={k} N={N} in_features_padded={in_features_padded} {dtype}"


def test_dequantize_layout_refuses_what_unrepack_refuses():
    _, cb, scale, packed, absmax = _storage(4, 100, 96)
    b, a = ops.repack(packed, absmax, 4, 100, 96)
    with pytest.raises(ValueError, match="absmax_gemm"):
        ops.dequantize_layout(b, a.reshape(-1), cb, 4, 100, 96, torch.float16, scale)
    with pytest.raises(ValueError, match="codebook"):
        ops.dequantize_layout(b, a, cb[:8], 4, 100, 96, torch.float16, scale)
    with pytest.raises((TypeError, ValueError), match="dtype"):
        ops.dequantize_layout(b, a, cb, 4, 100, 96, torch.int32, scale)


def _documented_code(b_gemm, k, row, col):
    """Read the code of (row, col) from B_gemm at the bit offsets that kbit/layout.py documents."""
    tile, rr = divmod(row, 16)
    block, i_tile = divmod(tile, 16)  # tile = 16 * block + i
    r, g = divmod(rr, 8)
    kgroup, cc = divmod(col, 256)
    t, c32 = divmod(cc, 32)
    p, qe = divmod(c32, 8)  # column 8p + 2q + e of the block: code s = 2p + e of lane 4g + q
    q, e = divmod(qe, 2)
    lane = 4 * g + q
    offsets = layout.pair_bit_offsets(k)[8 * t + 2 * p + r]
    code = 0
    for i in range(k):
        bit = int(offsets[e * k + i])
        vec, w, j = bit // 128, (bit % 128) // 32, bit % 32
        word = int(b_gemm[block, kgroup, i_tile, vec, lane, w]) & 0xFFFFFFFF
        code |= ((word >> j) & 1) << i
    return code, (block, kgroup, i_tile, r, g, t)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("shape", [(130, 288), (17, 544), (256, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_layout_documented_bit_offsets(k, shape):
    N, in_features_padded = shape
    nb = N * in_features_padded // 32
    packed = torch.randint(-(2**31), 2**31, (nb * k,), dtype=torch.int64).to(torch.int32)
    absmax = torch.randint(1, 256, (nb,), dtype=torch.int32).to(torch.uint8)
    codes = formats.unpack_bitplanes(packed, k).reshape(N, in_features_padded)
    b, a = layout.repack_reference(packed, absmax, k, N, in_features_padded)
    rows = torch.randint(0, N, (200,)).tolist() + [0, N - 1]
    cols = torch.randint(0, in_features_padded, (200,)).tolist() + [0, in_features_padded - 1]
    for row, col in zip(rows, cols):
        code, index = _documented_code(b, k, row, col)
        assert code == int(codes[row, col]), f"bits={k} N={N} {in_features_padded=}: code of ({row}, {col})"
        want_absmax = int(absmax[row * (in_features_padded // 32) + col // 32])
        assert int(a[index]) == want_absmax, f"absmax of ({row}, {col})"
    # Padding rows (past N) and columns (past in_features_padded) hold code 0 and absmax 0.
    n_pad = b.shape[0] * 256
    kg = b.shape[1]
    for row, col in [(N, 0), (n_pad - 1, in_features_padded - 1), (0, kg * 256 - 1)]:
        if row >= N or col >= in_features_padded:
            if row < n_pad and col < kg * 256:
                code, idx = _documented_code(b, k, row, col)
                assert code == 0 and int(a[idx]) == 0, f"padding at ({row}, {col})"


def test_layout_k4_pairs_are_bytes():
    # For k = 4 the documented pair index of codes s = 2p, 2p+1 is one byte of the lane's string.
    N, in_features_padded, k = 16, 256, 4
    codes = torch.randint(0, 16, (N, in_features_padded))
    packed = formats.pack_bitplanes(codes.reshape(-1, 32), k)
    absmax = torch.ones(N * in_features_padded // 32, dtype=torch.uint8)
    b, _ = layout.repack_reference(packed, absmax, k, N, in_features_padded)
    lane, g, q, t, r, p = 4 * 3 + 2, 3, 2, 5, 1, 3
    o = (8 * t + 2 * p + r) * 2 * k  # pair 8t + 2p + r: a multiple of 8, byte aligned
    assert o % 8 == 0
    word = int(b[0, 0, 0, o // 128, lane, (o % 128) // 32]) & 0xFFFFFFFF
    byte = (word >> (o % 32)) & 0xFF
    row, col = g + 8 * r, 32 * t + 8 * p + 2 * q
    assert byte == int(codes[row, col]) | (int(codes[row, col + 1]) << 4)


def test_layout_k3_pairs_are_byte_aligned():
    # For k = 3 the documented index of pair P = 16u + 4s + i is the low 6 bits of byte i of word 3u + s (s < 3),
    # or for s = 3 bits 6..7 of byte i of words 3u, 3u + 1, 3u + 2 (the index's bits 0-1, 2-3, 4-5).
    k, N, in_features_padded = 3, 16, 256
    codes = torch.randint(0, 8, (N, in_features_padded))
    packed = formats.pack_bitplanes(codes.reshape(-1, 32), k)
    absmax = torch.ones(N * in_features_padded // 32, dtype=torch.uint8)
    b, _ = layout.repack_reference(packed, absmax, k, N, in_features_padded)
    for lane in (0, 13, 31):
        g, q = divmod(lane, 4)
        string = [int(b[0, 0, 0, v, lane, w]) & 0xFFFFFFFF for v in range(k) for w in range(4)]
        for pair in range(64):
            t, pr = divmod(pair, 8)
            p, r = divmod(pr, 2)
            row, col = g + 8 * r, 32 * t + 8 * p + 2 * q
            want = int(codes[row, col]) | (int(codes[row, col + 1]) << k)
            u, s, i = pair // 16, pair // 4 % 4, pair % 4
            if s < 3:
                got = (string[3 * u + s] >> (8 * i)) & 0x3F
            else:
                got = sum(((string[3 * u + v] >> (8 * i + 6)) & 3) << (2 * v) for v in range(3))
            assert got == want, f"lane {lane} pair {pair}"


def test_layout_bad_shapes():  # the references trust their arguments: the functional API checks them
    with pytest.raises(ValueError, match="multiple of 32"):
        kbit.functional.repack_for_gemm(torch.zeros(12, dtype=torch.int32), torch.zeros(3, dtype=torch.uint8), 4, 2,
                                        48)
    with pytest.raises(ValueError, match="need packed of shape"):
        kbit.functional.repack_for_gemm(torch.zeros(12, dtype=torch.int32), torch.zeros(3, dtype=torch.uint8), 4, 4,
                                        32)


def test_weights_settled_once_read_at_their_version_and_address(monkeypatch):
    """The GEMM reads weights before the previous kernel has finished only where an earlier GEMM read them as they
    are now (kbit/ops.py): a new tensor, an in-place write or a new .data makes the next call wait."""
    monkeypatch.delenv(ops.EARLY_WEIGHTS_ENV, raising=False)
    b, a, cb = torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.uint8), torch.linspace(-1, 1, 16)
    assert not ops.weights_settled(b, a, cb)  # first read: waits
    assert ops.weights_settled(b, a, cb)
    assert ops.weights_settled(b, a, cb)
    b.add_(1)  # written in place: the version moves
    assert not ops.weights_settled(b, a, cb)
    assert ops.weights_settled(b, a, cb)
    a.data = torch.ones(4, dtype=torch.uint8)  # new storage under the same tensor
    assert not ops.weights_settled(b, a, cb)
    assert ops.weights_settled(b, a, cb)
    assert not ops.weights_settled(b.clone(), a, cb)  # a new tensor
    assert not ops.weights_settled(b, a, cb[:])  # a view: another tensor object, read the first time
    cb.copy_(torch.linspace(-1, 1, 16))  # same values, still a write
    assert not ops.weights_settled(b, a, cb)
    assert ops.weights_settled(b, a, cb)
    monkeypatch.setenv(ops.EARLY_WEIGHTS_ENV, "0")
    assert not ops.weights_settled(b, a, cb)
    monkeypatch.delenv(ops.EARLY_WEIGHTS_ENV)
    with torch.inference_mode():
        frozen = torch.zeros(8, dtype=torch.int32)  # an inference tensor keeps no version: never settled
    assert not ops.weights_settled(frozen, a, cb)
    assert not ops.weights_settled(frozen, a, cb)


# ----------------------------------------------------------------------------- torch.compile on CPU
@pytest.mark.slow
def test_compile_matmul_fullgraph():
    torch._dynamo.reset()
    qw = kbit.quantize(torch.randn(200, 96), bits=3)
    bias = torch.randn(200)

    def f(x):
        return kbit.matmul(x, qw, bias=bias)

    cf = torch.compile(f, fullgraph=True)
    for shape in [(4, 96), (2, 5, 96)]:
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(shape).to(dtype)
            torch.testing.assert_close(cf(x), f(x), msg=lambda m: f"x={shape} {_name(dtype)}: {m}")


def test_compile_ops_fullgraph_aot_eager():
    # The GEMM layout path (what CUDA runs) traced with a cold cache, through the fake impls.
    torch._dynamo.reset()
    qw = kbit.quantize(torch.randn(130, 64), bits=5)

    def g(x):
        b, a = qw.gemm_layout()
        y = ops.gemm(x, b, a, qw.codebook, qw.scale, None, qw.bits, 130, 64, 0)
        w = ops.dequantize(qw.packed, qw.absmax, qw.codebook, qw.bits, 130 * 64, torch.float32, qw.scale)
        return y, w

    x = torch.randn(3, 64, dtype=torch.float16)
    y, w = torch.compile(g, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(y, kbit.matmul(x, qw))
    torch.testing.assert_close(w.reshape(130, 64), kbit.dequantize(qw, torch.float32))
    assert qw._gemm is not None


class TinyLM(nn.Module):
    def __init__(self, d=128, f=256, vocab=300):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(torch.nn.functional.silu(self.up(h)))
        return self.lm_head(h)


@pytest.mark.slow
def test_compile_model_with_kbit_linear_fullgraph():
    torch._dynamo.reset()
    model = TinyLM().eval()
    kbit.quantize_model(model, bits=4, min_features=64, progress=False)
    assert isinstance(model.up, kbit.KbitLinear) and isinstance(model.down, kbit.KbitLinear)
    ids = torch.randint(0, 300, (2, 7))
    with torch.no_grad():
        eager = model(ids)
        model.up._invalidate()  # cold QuantizedWeight cache inside the compiled region
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(ids), eager)
        other = torch.randint(0, 300, (3, 5))
        torch.testing.assert_close(compiled(other), model(other))


# ----------------------------------------------------------------------------- autograd through the GEMM op
@pytest.mark.parametrize("K_x", [96, 70])
def test_gemm_backward_matches_reference(K_x):
    # The CUDA path of kbit.matmul is ops.gemm; its gradients (x and bias; the weight is constant)
    # must match autograd through x @ W_hat.T + bias (in float32, rounded to x's dtype as the op rounds them).
    # On CPU ops.gemm runs the CPU kernel (through unrepack), for the activation dtypes the CUDA kernel takes.
    N, in_features_padded = 130, 96
    qw = kbit.quantize(torch.randn(N, in_features_padded), bits=3)
    b, a = qw.gemm_layout()
    w = kbit.dequantize(qw, torch.float32)
    x = torch.randn(5, K_x, dtype=torch.float16, requires_grad=True)
    bias = torch.randn(N, dtype=torch.float16, requires_grad=True)
    y = ops.gemm(x, b, a, qw.codebook, qw.scale, bias, 3, N, in_features_padded, 0)
    g = torch.randn_like(y)
    gx, gb = torch.autograd.grad(y, (x, bias), g)
    x2 = x.detach().float().requires_grad_()
    b2 = bias.detach().float().requires_grad_()
    rx, rb = torch.autograd.grad(x2 @ w[:, :K_x].T + b2, (x2, b2), g.float())
    torch.testing.assert_close(gx, rx.half())
    torch.testing.assert_close(gb, rb.half())
    torch.library.opcheck(ops.gemm, (x.detach().requires_grad_(), b, a, qw.codebook, qw.scale,
                                     bias.detach().requires_grad_(), 3, N, in_features_padded, 0))


def test_compile_gemm_op_with_grad_enabled():
    # torch.compile outside no_grad (inputs that require grad) must trace through ops.gemm:
    # this is what KbitLinear runs on CUDA.
    torch._dynamo.reset()
    qw = kbit.quantize(torch.randn(130, 64), bits=4)
    b, a = qw.gemm_layout()
    bias = torch.randn(130, dtype=torch.float16, requires_grad=True)

    def f(x):
        return ops.gemm(x, b, a, qw.codebook, qw.scale, bias, 4, 130, 64, 0)

    x = torch.randn(3, 64, dtype=torch.float16, requires_grad=True)
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(y, f(x))
    y.float().sum().backward()
    assert x.grad is not None and bias.grad is not None


def test_compile_kbit_model_with_grad_enabled():
    torch._dynamo.reset()
    model = TinyLM()
    kbit.quantize_model(model, bits=4, min_features=64, progress=False)
    ids = torch.randint(0, 300, (2, 5))
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(ids)
    torch.testing.assert_close(out, model(ids))
    out.sum().backward()
    assert model.up.bias.grad is not None and model.embed.weight.grad is not None


@pytest.mark.parametrize("M", [1, 5])
def test_direct_calls_run_the_registered_kernel_where_no_autograd_or_tracer_takes_part(M, monkeypatch):
    """gemm_direct / matmul_stored_direct: in a plain eager call the device's kernel itself (the op's dispatch costs
    more host time than a small layer's GEMM), bit for bit the op's result; the op where x requires grad (the
    result carries its backward) or is a tensor subclass."""
    torch.manual_seed(M)
    N, K = 48, 96
    qw = kbit.quantize(torch.randn(N, K), 4)
    x, bias = torch.randn(M, K, dtype=torch.bfloat16), torch.randn(N, dtype=torch.bfloat16)
    Kp = qw.in_features_padded
    packed, absmax = qw.storage()
    b, a = qw.gemm_layout()
    cases = [(ops.gemm_direct, ops.gemm, ops.GEMM_KERNELS, (b, a, qw.codebook, qw.scale, bias, 4, N, Kp, 0)),
             (ops.matmul_stored_direct, ops.matmul_stored, ops.MATMUL_STORED_KERNELS,
              (packed, absmax, qw.codebook, qw.scale, bias, 4, N, Kp))]
    for direct, op, kernels, args in cases:
        ran = []
        kernel = kernels["cpu"]
        monkeypatch.setitem(kernels, "cpu", lambda *a, kernel=kernel: ran.append(1) or kernel(*a))
        expected = op(x, *args)
        assert torch.equal(direct(x, *args), expected) and ran == [1]
        with torch.no_grad():
            assert torch.equal(direct(x.clone().requires_grad_(), *args), expected) and ran == [1, 1]
        through_op = direct(x.clone().requires_grad_(), *args)
        assert through_op.grad_fn is not None and torch.equal(through_op.detach(), expected) and ran == [1, 1]
        subclass = x.as_subclass(_Marked)
        assert torch.equal(direct(subclass, *args).as_subclass(torch.Tensor), expected) and ran == [1, 1]


class _Marked(torch.Tensor):
    """A tensor subclass (as fake and distributed tensors are): calls with one take the op."""


def test_direct_calls_take_the_op_under_a_dispatch_mode(monkeypatch):
    """make_fx and FakeTensorMode trace through dispatch modes: there the op runs (they record it), never its kernel
    behind their back."""
    from torch.fx.experimental.proxy_tensor import make_fx

    qw = kbit.quantize(torch.randn(32, 64), 4)
    packed, absmax = qw.storage()
    args = (packed, absmax, qw.codebook, qw.scale, None, 4, 32, qw.in_features_padded)
    ran = []
    kernel = ops.MATMUL_STORED_KERNELS["cpu"]
    monkeypatch.setitem(ops.MATMUL_STORED_KERNELS, "cpu", lambda *a: ran.append(1) or kernel(*a))
    traced = make_fx(lambda x: ops.matmul_stored_direct(x, *args))(torch.randn(2, 64))
    assert ran == [] and any(n.target is torch.ops.kbit.matmul_stored.default for n in traced.graph.nodes)
    ops.matmul_stored_direct(torch.randn(2, 64), *args)
    assert ran == [1]
