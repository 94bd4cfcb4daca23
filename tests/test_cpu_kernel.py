"""The CPU kernels (kbit/csrc/cpu, built by kbit._build_cpu) against the pure-PyTorch reference path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import kbit
from kbit import _build_cpu, formats, functional, layout, ops
from kbit.weight import quantize_with_report
from kbit.moe import KbitExperts

BITS = formats.SUPPORTED_BITS


@pytest.fixture(scope="module")
def ext():
    """The built kernels; where a compiler exists they must build (a broken build fails here, not skips)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the reference path is all there is")
    built = _build_cpu.cpu_ext()
    assert built is not None, "a C++ compiler exists but the CPU kernels did not build"
    return built


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def _weight(out_features: int, in_features: int, bits: int, dtype=torch.float32) -> kbit.QuantizedWeight:
    W = torch.randn(out_features, in_features, dtype=dtype)
    W[0, : min(in_features, 40)] *= 1e-4  # blocks far below the largest: small E4M4 exponents and subnormals
    if out_features > 2:
        W[2] = 0  # all-zero blocks (absmax 0)
    qw, _ = quantize_with_report(W, bits)
    return qw


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_bit_exact(ext, threads, bits, dtype):
    qw = _weight(37, 75, bits)
    n = qw.out_features * qw.in_features_padded - 5  # a flat length that ends inside a block
    got = ops.dequantize(qw.packed, qw.absmax, qw.codebook, bits, n, dtype, qw.scale)
    want = formats.dequantize_reference(qw.packed, qw.absmax, qw.codebook, bits, n, dtype, qw.scale)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_gives_the_reference_codes(ext, threads, bits, dtype):
    A = torch.randn(4099, dtype=dtype) * torch.logspace(-6, 2, 4099).to(dtype)  # absmax across E4M4's range
    A[100:164] = 0
    cb = formats.create_normal_float_codebook(bits)
    scale = formats.choose_tensor_scale(A.abs().amax())
    packed, absmax = ops.quantize(A, cb, bits, scale)
    want_packed, want_absmax = formats.quantize_reference(A, cb, bits, scale)
    assert torch.equal(absmax, want_absmax) and torch.equal(packed, want_packed)


def _assert_within_rounding(got: torch.Tensor, want_fp32: torch.Tensor, dtype) -> None:
    """Equal up to a different fp32 summation order, then one rounding to ``dtype``."""
    assert got.dtype == dtype and got.shape == want_fp32.shape
    sum_order = 1e-5 * want_fp32.abs().amax()  # K <= ~300 terms of magnitude <= max|y|
    rounding = want_fp32.abs() * (torch.finfo(dtype).eps if dtype != torch.float32 else 0.0)
    err = (got.to(torch.float32) - want_fp32).abs()
    assert bool((err <= sum_order + rounding).all()), f"max error {err.max()}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 13, 16, 70, 1030])  # every chunk size, the BLAS path from 1024
def test_matmul_matches_reference(ext, threads, bits, dtype, rows):
    out_features, in_features = 19, 83  # odd: tails of every tile, a partial last block
    qw = _weight(out_features, in_features, bits)
    x = torch.randn(rows, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    got = kbit.matmul(x, qw, bias)
    want = ops.matmul_stored_reference(x.to(torch.float32), qw.packed, qw.absmax, qw.codebook, qw.scale,
                                       bias.to(torch.float32), bits, out_features, qw.in_features_padded)
    _assert_within_rounding(got, want, dtype)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16])
def test_matmul_row_lanes_match_reference(ext, threads, bits, rows):
    """Shapes for the row-lane kernels (AVX-512, K <= 4): groups of 16 output rows in tiles of 64, 32 and 16, a last
    group of 5 rows, 42 blocks per row (spans of 16 blocks, the last one partial), odd in_features, bias;
    and the output's memory last held NaNs, so a row the kernels skip cannot pass."""
    out_features, in_features = 85, 1313
    qw = _weight(out_features, in_features, bits)
    bias = torch.randn(out_features)
    torch.ops.kbit_cpu.gemm(torch.full((rows, in_features), float("nan")), qw.packed, qw.absmax, qw.codebook,
                            qw.scale, None, bits, out_features, qw.in_features_padded)
    x = torch.randn(rows, in_features)
    got = torch.ops.kbit_cpu.gemm(x, qw.packed, qw.absmax, qw.codebook, qw.scale, bias, bits, out_features,
                                  qw.in_features_padded)
    want = ops.matmul_stored_reference(x, qw.packed, qw.absmax, qw.codebook, qw.scale, bias, bits, out_features,
                                       qw.in_features_padded)
    _assert_within_rounding(got, want, torch.float32)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_a_rows_output_does_not_depend_on_the_rows_after_it(ext, bits, rows):
    """The first 37 rows of a weight alone give the same bits as within all 64 (a partial last lane group against a
    whole one): fused sibling projections (kbit.fusion) rely on it to equal each projection's own call on the CPU."""
    qw = _weight(64, 300, bits)
    kept = 37
    packed = qw.packed.view(64, -1)[:kept].reshape(-1)
    absmax = qw.absmax.view(64, -1)[:kept].reshape(-1)
    x, bias = torch.randn(rows, 300), torch.randn(64)
    whole = torch.ops.kbit_cpu.gemm(x, qw.packed, qw.absmax, qw.codebook, qw.scale, bias, bits, 64,
                                    qw.in_features_padded)
    part = torch.ops.kbit_cpu.gemm(x, packed, absmax, qw.codebook, qw.scale, bias[:kept], bits, kept,
                                   qw.in_features_padded)
    assert torch.equal(part, whole[:, :kept])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows", [1, 5])
def test_matmul_split_over_threads(ext, threads, bits, rows):
    """A layer large enough (over 2^19 weights per thread) that both threads take output rows."""
    qw = _weight(1100, 1000, bits)
    x = torch.randn(rows, 1000)
    want = ops.matmul_stored_reference(x, qw.packed, qw.absmax, qw.codebook, qw.scale, None, bits, 1100,
                                       qw.in_features_padded)
    _assert_within_rounding(kbit.matmul(x, qw), want, torch.float32)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("leading", [(2, 5), (1, 1)])
def test_matmul_3d_input(ext, threads, bits, leading):
    qw = _weight(33, 65, bits)
    bias = torch.randn(33)
    x = torch.randn(*leading, 65)
    want = x @ qw.dequantize(torch.float32).T
    assert kbit.matmul(x, qw).shape == (*leading, 33)
    _assert_within_rounding(kbit.matmul(x, qw), want, torch.float32)
    _assert_within_rounding(kbit.matmul(x, qw, bias), want + bias, torch.float32)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(17, 544), (300, 96), (260, 1000)])  # tails of the 256-row and -column tiles
def test_unrepack_is_bit_exact(ext, threads, bits, shape):
    qw = _weight(*shape, bits)
    N, K = qw.out_features, qw.in_features_padded
    b, a = layout.repack_reference(qw.packed, qw.absmax, bits, N, K)
    packed, absmax = ops.unrepack(b, a, bits, N, K)
    assert torch.equal(packed, qw.packed) and torch.equal(absmax, qw.absmax)


@pytest.mark.parametrize("bits", [2, 5])
def test_layout_gemm_uses_the_kernel(ext, monkeypatch, bits):
    calls = _counting_kernel(ext, monkeypatch)
    qw = _weight(40, 83, bits)
    b, a = qw.gemm_layout()
    x = torch.randn(3, 83, dtype=torch.bfloat16)
    bias = torch.randn(40, dtype=torch.bfloat16)
    got = functional.kbit_gemm(x, b, a, qw.codebook, bits, 40, qw.in_features_padded, bias=bias, scale=qw.scale)
    want = ops.matmul_stored_reference(x.float(), qw.packed, qw.absmax, qw.codebook, qw.scale, bias.float(), bits, 40,
                                       qw.in_features_padded)
    _assert_within_rounding(got, want, torch.bfloat16)
    assert calls == [(3, 83)]


def test_matmul_gradients_through_the_kernel(ext):
    qw = _weight(17, 45, 4)
    x = torch.randn(3, 45, requires_grad=True)
    bias = torch.randn(17, requires_grad=True)
    kbit.matmul(x, qw, bias).square().sum().backward()
    x_ref, bias_ref = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    (x_ref @ qw.dequantize(torch.float32).T + bias_ref).square().sum().backward()
    # Each gradient is a sum of products that cancel; fp32 rounding of the summands scales with the largest of them,
    # not with the (sometimes near-zero) result, so the tolerance does too.
    for got, want in ((x.grad, x_ref.grad), (bias.grad, bias_ref.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def _counting_kernel(ext, monkeypatch):
    """Counts the calls of the CPU GEMM kernel made through ``kbit.ops`` (x's shape each)."""
    calls = []
    real = ext.gemm

    class Counting:  # torch.ops namespaces are read-only: stand in for the one the ops call
        def __getattr__(self, name):
            return getattr(ext, name)

        def gemm(self, *args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(ops, "cpu_ext", lambda: Counting())
    return calls


def test_kbit_linear_and_experts_use_the_kernel(ext, monkeypatch):
    calls = _counting_kernel(ext, monkeypatch)
    linear = torch.nn.Linear(70, 24)
    layer = kbit.KbitLinear.from_linear(linear, bits=4)
    x = torch.randn(4, 70)
    want = x @ layer.qweight.dequantize(torch.float32).T + linear.bias.detach()
    _assert_within_rounding(layer(x), want, torch.float32)
    assert calls == [(4, 70)]

    experts = KbitExperts(3, 32, 16, bits=4)
    idx = torch.tensor([[0, 2], [2, 1]])
    experts(torch.randn(2, 32), idx, torch.rand(2, 2))
    assert len(calls) == 1 + 2 * 3  # gate_up and down of each routed expert


def test_without_a_compiler_one_warning_and_the_reference(monkeypatch):
    qw = _weight(9, 40, 4)
    x = torch.randn(2, 40)
    monkeypatch.setattr(_build_cpu, "_compiler", lambda: None)
    monkeypatch.delenv(_build_cpu.ENABLE_ENV, raising=False)
    _build_cpu.cpu_ext.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = kbit.matmul(x, qw)
            kbit.matmul(x, qw)
            kbit.quantize(torch.randn(8, 32))
        ours = [w for w in caught if issubclass(w.category, _build_cpu.CpuKernelWarning)]
        assert len(ours) == 1 and "C++ compiler" in str(ours[0].message)
        want = ops.matmul_stored_reference(x, qw.packed, qw.absmax, qw.codebook, qw.scale, None, 4, 9, 64)
        assert torch.equal(got, want)
    finally:
        _build_cpu.cpu_ext.cache_clear()


def test_isa_choice_errors(monkeypatch):
    if not _build_cpu.isa() in _build_cpu.X86_ISAS:
        pytest.skip("an x86-64 choice")
    monkeypatch.setenv(_build_cpu.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="KBIT_CPU_ISA must be one of"):
        _build_cpu.isa()
    monkeypatch.setenv(_build_cpu.ISA_ENV, "avx2")
    monkeypatch.setattr(_build_cpu, "_cpu_flags", lambda: {"sse2"})
    with pytest.raises(ValueError, match="lacks"):
        _build_cpu.isa()


_VARIANT_CHECK = """
import torch, kbit, kbit.weight
from kbit import _build_cpu, ops
assert _build_cpu.cpu_ext().isa() == {isa!r}
for bits in (2, 3, 4, 5):
    qw, _ = kbit.weight.quantize_with_report(torch.randn(37, 600), bits)
    for rows in (1, 5, 16):
        x = torch.randn(rows, 600)
        want = ops.matmul_stored_reference(x, qw.packed, qw.absmax, qw.codebook, qw.scale, None, bits, 37, 608)
        assert (kbit.matmul(x, qw) - want).abs().max() <= 1e-5 * want.abs().max()
    b, a = kbit.layout.repack_reference(qw.packed, qw.absmax, bits, 37, 608)
    assert all(map(torch.equal, ops.unrepack(b, a, bits, 37, 608), (qw.packed, qw.absmax)))
    n = 37 * 608
    assert torch.equal(qw.dequantize(torch.float32), qw.dequantize(torch.float32))
    assert torch.equal(ops.dequantize(qw.packed, qw.absmax, qw.codebook, bits, n, torch.float32, qw.scale),
                       kbit.formats.dequantize_reference(qw.packed, qw.absmax, qw.codebook, bits, n, torch.float32,
                                                         qw.scale))
"""


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_smaller_instruction_sets(ext, isa):
    """The other SIMD layers this CPU can run, each built and checked in a fresh process (a minute each)."""
    if isa not in _build_cpu.X86_ISAS or not _build_cpu.X86_ISAS[isa][0] <= _build_cpu._cpu_flags():
        pytest.skip(f"this CPU cannot run {isa}")
    env = dict(os.environ, KBIT_CPU_ISA=isa)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _VARIANT_CHECK.format(isa=isa)], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def _counting_op(monkeypatch):
    """Counts the ``kbit::matmul_stored`` calls (the op, or its kernel without the op's dispatch) made through
    ``QuantizedWeight._matmul_stored``."""
    calls = []
    real = ops.matmul_stored_direct

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(ops, "matmul_stored_direct", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kbit_linear_skips_the_op_without_autograd(ext, monkeypatch, dtype):
    layer = kbit.KbitLinear.from_linear(torch.nn.Linear(83, 24).to(dtype), bits=3)
    x = torch.randn(2, 3, 83, dtype=dtype)
    with torch.no_grad():
        want = layer.qweight._matmul_stored(x.reshape(6, 83), layer.bias).reshape(2, 3, 24)
    calls = _counting_op(monkeypatch)
    with torch.no_grad():
        assert torch.equal(layer(x), want)
    with torch.inference_mode():
        assert torch.equal(layer(x), want)
    assert calls == []
    y = layer(x)  # the bias is a parameter: autograd needs the op
    assert calls == [(6, 83)] and y.requires_grad and torch.equal(y.detach(), want)
    layer.bias.requires_grad_(False)
    x.requires_grad_(True)
    layer(x).sum().backward()
    assert len(calls) == 2 and x.grad is not None


def test_kbit_linear_direct_kernel_follows_the_buffers(ext):
    import copy

    layer = kbit.KbitLinear.from_linear(torch.nn.Linear(64, 16), bits=4)
    other = kbit.KbitLinear.from_linear(torch.nn.Linear(64, 16), bits=4)
    x = torch.randn(1, 64)
    with torch.no_grad():
        before = layer(x)
        twin = copy.deepcopy(layer)
        twin.absmax.zero_()  # the copy binds its own tensors, the original keeps its own
        assert torch.equal(layer(x), before) and torch.equal(twin(x), twin.bias.expand(1, 16))
        layer.packed, layer.absmax = other.packed, other.absmax
        layer.bias = other.bias
        assert torch.equal(layer(x), other(x))


def test_kbit_linear_compiled_uses_the_op(ext):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = kbit.KbitLinear.from_linear(torch.nn.Linear(64, 16), bits=4)
    x = torch.randn(2, 64)
    with torch.no_grad():
        y = torch.compile(layer, backend=backend, fullgraph=True)(x)
        assert torch.equal(y, layer(x))
    targets = [node.target for gm in graphs for node in gm.graph.nodes]
    assert torch.ops.kbit.matmul_stored.default in targets
