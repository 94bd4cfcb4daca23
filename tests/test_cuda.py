"""GPU tests of kbit's CUDA kernels (skipped without CUDA).

What is checked, against the pure-PyTorch reference in ``kbit.formats`` / ``kbit.layout``:

* ``kbit::quantize``, ``kbit::dequantize`` and ``kbit::repack`` on CUDA are bit-exact, for every
  K, every input/output dtype, sizes that are and are not multiples of the block / tile sizes,
  default and custom codebooks, per-tensor scales != 1, and ties on codebook midpoints.
* The fused GEMM (``kbit.matmul``) is within a tolerance derived from a same-precision PyTorch
  computation, as flash-attention tests do: with ``ref32`` = fp32 product of the fp32
  dequantized weight and ``ref_lp`` = ``F.linear`` in the input dtype on the same GPU,
  ``max|out - ref32| <= 2 * max|ref_lp - ref32| + atol`` (atol = half an output ulp at the largest
  |ref32| + 1e-5 * max|ref32|: one output rounding step is inherent) and
  ``rel_fro(out) <= 2 * rel_fro(ref_lp) + 1e-5``. Every K, fp16 and bf16, M in {1, 2, 3, 5, 16,
  17, 31, 33, 64, 100, 256}, odd shapes and the seeds' model shapes, custom codebooks, bias,
  leading batch dims, M = 0, K % 32 != 0.
* Forced split-K (``grid_override=g``) is deterministic: 200 repeats give bitwise identical results.
* CUDA-graph capture and ``torch.compile(fullgraph=True)`` of the ops and of ``KbitLinear``.
* ``test_sanitize_*``: small, fast tests for ``compute-sanitizer`` (memcheck, racecheck); select
  them with ``-k sanitize``. They avoid cuBLAS and compare against CPU references.

Every run draws fresh random inputs from a session seed printed in every failure message; set
``KBIT_TEST_SEED=<seed>`` to replay a run. Outputs are poisoned before every kernel call: right
before the call, buffers of the outputs' sizes are allocated (in the op's allocation order),
filled with 0xFF bytes (NaN for floating outputs) and freed, so PyTorch's caching allocator hands
exactly that memory to the op; any element the kernel fails to write then shows up as a
mismatch or a NaN.
"""

from __future__ import annotations

import math
import os
import random
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F

import kbit
import kbit.functional
from kbit import formats, layout, ops
from kbit._validate import check_codebook

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
    pytest.mark.usefixtures("ieee_fp32_matmul"),  # fp32 references are real fp32 products (conftest.py)
]

SESSION_SEED = int(os.environ.get("KBIT_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
SPLITK_REPS = int(os.environ.get("KBIT_SPLITK_REPS", "200"))

BITS = (2, 3, 4, 5)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GEMM_DTYPES = (torch.float16, torch.bfloat16)
SIZES = (1, 31, 32, 33, 1000, 8192 * 2 + 32 * 77, 8192 * 3 + 17, 1 << 20)
GEMM_MS = (1, 2, 3, 5, 16, 17, 31, 33, 64, 100, 160, 256)

# (N_out, K_in). Small odd shapes: N not a multiple of 128, K not a multiple of 256 (partial
# k-groups), K % 32 != 0 with K % 8 == 0 (x narrower than the layout's K_dim) and K % 8 != 0
# (kbit.matmul pads x).
SMALL_SHAPES = ((128, 32), (384, 96), (1000, 4128), (136, 256), (8, 64), (200, 1056), (130, 4104), (256, 40),
                (72, 100))
# The seeds' model shapes, K_in -> N_out written as (N_out, K_in).
MODEL_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (4096, 11008), (1536, 2048), (10240, 2048))
BIG_SHAPE = (28672, 8192)  # Llama-3-70B gate/up: only a few M


def _name(x) -> str:
    return str(x).replace("torch.", "")


def seed_for(*params) -> int:
    """A per-test seed derived from the session seed and the test's parameters."""
    return (SESSION_SEED * 1000003 + zlib.crc32(repr(params).encode())) % (1 << 31)


def tag(seed: int, **params) -> str:
    items = " ".join(f"{k}={_name(v)}" for k, v in params.items())
    return f"[KBIT_TEST_SEED={SESSION_SEED} seed={seed} {items}]"


# ----------------------------------------------------------------------------- helpers
_POISON_STATS = {"calls": 0, "hits": 0}


def poison(*specs, byte: int = 0xFF) -> list:
    """Hand the op's outputs poisoned memory through the caching allocator.

    ``specs`` are ``(numel, dtype)`` of the op's outputs in the order the op allocates them. The
    caching allocator is deterministic: allocating these sizes, filling them and freeing them
    restores its state, so the op's own allocations of the same sizes get the same (now
    poisoned) blocks. Create every input on the GPU *before* calling this.
    """
    bufs = []
    for numel, dtype in specs:
        if numel:
            b = torch.empty(numel, dtype=dtype, device="cuda")
            b.view(torch.uint8).fill_(byte)
            bufs.append(b)
    ptrs = [b.data_ptr() for b in bufs]
    del bufs
    return ptrs


def poisoned(ptrs: list, *outs: torch.Tensor) -> None:
    """Count whether the op's outputs landed on the poisoned blocks (see test_poison_coverage)."""
    outs = [o for o in outs if o.numel()]
    if ptrs and outs:
        _POISON_STATS["calls"] += 1
        _POISON_STATS["hits"] += all(o.data_ptr() in ptrs for o in outs)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-for-bit equality (NaN patterns and signed zeros included), with a useful message."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    g = _bits(got.detach().cpu().contiguous()).reshape(-1)
    w = _bits(want.detach().cpu().contiguous()).reshape(-1)
    bad = (g != w).nonzero().reshape(-1)
    if bad.numel():
        first = bad[:6].tolist()
        gv = got.detach().cpu().reshape(-1)[first].tolist()
        wv = want.detach().cpu().reshape(-1)[first].tolist()
        raise AssertionError(
            f"{what}: {bad.numel()} of {g.numel()} elements differ; first flat indices {first} "
            f"(block {[i // 32 for i in first]}): got {gv}, expected {wv}"
        )


def assert_no_nan(t: torch.Tensor, what: str) -> None:
    if t.is_floating_point() and t.numel():
        n = int(torch.isnan(t).sum())
        assert n == 0, f"{what}: {n} NaN(s) in the output (unwritten, poisoned elements?)"


def gen(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def blocky_tensor(n: int, dtype, seed: int) -> torch.Tensor:
    """CPU tensor of n elements whose 32-blocks have absmax spread over E4M4's whole range.

    Block absmax values run from below half the smallest subnormal (encodes to 0) up to ~30,
    with some all-zero blocks, so every E4M4 path (subnormal, normal, rounding carry) is hit.
    """
    g = gen(seed)
    nb = formats.block_count(n)
    x = torch.randn(nb, 32, generator=g)
    x = x / x.abs().amax(dim=1, keepdim=True)
    target = torch.exp2(torch.empty(nb).uniform_(-15.5, 4.9, generator=g))
    target[torch.rand(nb, generator=g) < 0.03] = 0.0
    x = (x * target[:, None]).reshape(-1)[:n]
    return x.to(dtype)


def make_codebook(k: int, kind: str, seed: int) -> torch.Tensor:
    """'nf': the default normal-float codebook; 'custom': a random asymmetric one."""
    if kind == "nf":
        return kbit.functional.create_normal_float_codebook(k)
    g = gen(seed + 7)
    while True:
        v = torch.sort(torch.rand(2**k, generator=g) * 1.6 - 1.0).values  # in [-1, 0.6)
        v[0] = -1.0
        if bool((v[1:] > v[:-1]).all()):
            return check_codebook(v, k)


def random_storage(n: int, k: int, seed: int):
    """Random storage-format tensors (every bit pattern, every E4M4 code) for n elements, on CPU."""
    g = gen(seed)
    nb = formats.block_count(n)
    packed = torch.randint(-(2**31), 2**31, (nb * k,), generator=g, dtype=torch.int64).to(torch.int32)
    absmax = torch.randint(0, 256, (nb,), generator=g, dtype=torch.int64).to(torch.uint8)
    return packed, absmax


# ----------------------------------------------------------------------------- harness self-test
def test_poison_reaches_next_allocation():
    """The poisoning trick works with this allocator configuration (else the tests are weaker)."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        pytest.skip("caching allocator disabled")
    keep = torch.ones(12345, device="cuda")  # some unrelated live allocation
    poison((4096 * 7, torch.float16))
    y = torch.empty(4096 * 7, dtype=torch.float16, device="cuda")
    assert bool(torch.isnan(y).all()), "poisoned memory was not handed to the next same-size allocation"
    del keep


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


@pytest.mark.parametrize("N,K_dim", REPACK_SHAPES)
@pytest.mark.parametrize("k", BITS)
def test_repack_bit_exact(k, N, K_dim):
    seed = seed_for("repack", k, N, K_dim)
    msg = tag(seed, op="repack", bits=k, N=N, K_dim=K_dim)
    packed, absmax = random_storage(N * K_dim, k, seed)
    p_c, a_c = packed.cuda(), absmax.cuda()
    if N * K_dim <= (1 << 20):
        want_b, want_a = layout.repack_reference(packed, absmax, k, N, K_dim)
    else:  # the same pure-integer reference, run on the GPU for speed
        want_b, want_a = layout.repack_reference(p_c, a_c, k, N, K_dim)
    b_shape, a_shape = layout.gemm_shapes(k, N, K_dim)
    ptrs = poison((math.prod(b_shape), torch.int32), (math.prod(a_shape), torch.uint8))
    got_b, got_a = ops.repack(p_c, a_c, k, N, K_dim)
    poisoned(ptrs, got_b, got_a)
    assert got_b.is_contiguous() and got_a.is_contiguous(), msg
    assert_bits_equal(got_a, want_a, f"absmax_gemm {msg}")
    assert_bits_equal(got_b, want_b, f"B_gemm {msg}")
    back_p, back_a = ops.unrepack(got_b, got_a, k, N, K_dim)
    assert_bits_equal(back_p, p_c, f"unrepack(repack(x)).packed {msg}")
    assert_bits_equal(back_a, a_c, f"unrepack(repack(x)).absmax {msg}")


# ----------------------------------------------------------------------------- GEMM
def quantized_weight(N: int, K: int, k: int, seed: int, cb_kind: str = "nf") -> kbit.QuantizedWeight:
    W = torch.randn(N, K, generator=gen(seed, "cuda"), device="cuda", dtype=torch.float32) * 0.02
    qw = kbit.quantize(W.to(torch.float16), k, codebook=None if cb_kind == "nf" else make_codebook(k, cb_kind, seed))
    qw.gemm_layout()  # derive the layout before any poisoning / capture
    return qw


class GemmChecker:
    """Tolerance check of kbit.matmul against fp32 and same-precision references."""

    def __init__(self, qw: kbit.QuantizedWeight):
        self.qw = qw
        self.w32 = kbit.dequantize(qw, torch.float32)
        self._w_lp = {}

    def w_lp(self, dtype):
        if dtype not in self._w_lp:
            self._w_lp[dtype] = kbit.dequantize(self.qw, dtype)
        return self._w_lp[dtype]

    def stats(self, x: torch.Tensor, bias, out: torch.Tensor) -> dict:
        """Return error statistics and whether they pass."""
        x2 = x.reshape(-1, x.shape[-1])
        o2 = out.reshape(-1, out.shape[-1]).float()
        ref32 = x2.float() @ self.w32.T
        if bias is not None:
            ref32 = ref32 + bias.float()
        ref_lp = F.linear(x2, self.w_lp(x.dtype), bias).float()
        e, e_lp = o2 - ref32, ref_lp - ref32
        scale_out = float(ref32.abs().max())
        eps = torch.finfo(x.dtype).eps
        # Both out and ref_lp are rounded to x.dtype, so one output rounding step (half an ulp at
        # the largest magnitude) is inherent; without it, the max over a few large elements is
        # noisy (ref_lp may happen to round favourably where the kernel does not).
        half_ulp = 0.5 * eps * 2.0 ** math.floor(math.log2(scale_out)) if scale_out > 0 else 0.0
        slack = half_ulp + 1e-5 * scale_out
        rel_slack = 1e-5
        if o2.numel() < 1024:  # few outputs: the Frobenius ratio of rounding errors is noisy too
            rel_slack += 0.5 * eps
        norm = max(float(torch.linalg.vector_norm(ref32)), 1e-30)
        st = dict(
            max_err=float(e.abs().max()), max_lp=float(e_lp.abs().max()), scale_out=scale_out,
            rel=float(torch.linalg.vector_norm(e)) / norm, rel_lp=float(torch.linalg.vector_norm(e_lp)) / norm,
            nan=int(torch.isnan(o2).sum()), inf=int(torch.isinf(o2).sum()),
        )
        st["ok"] = (
            st["nan"] == 0 and st["inf"] == 0
            and st["max_err"] <= 2 * st["max_lp"] + slack
            and st["rel"] <= 2 * st["rel_lp"] + rel_slack
        )
        st["bound"] = 2 * st["max_lp"] + slack
        return st

    @staticmethod
    def describe(st: dict) -> str:
        return (f"max|out-ref32|={st['max_err']:.4g} (bound {st['bound']:.4g}, max|ref_lp-ref32|={st['max_lp']:.4g}, "
                f"max|ref32|={st['scale_out']:.4g}), rel_fro={st['rel']:.4g} (ref_lp {st['rel_lp']:.4g}), "
                f"nan={st['nan']} inf={st['inf']}")


def run_matmul(x, qw, bias=None, grid_override=0, do_poison=True):
    N, K = qw.shape
    if not do_poison:
        return kbit.matmul(x, qw, bias, grid_override=grid_override)
    M = x.numel() // K
    specs = []  # kbit.matmul's own allocations before the op's output: a padded or contiguous x
    if K % 8:
        specs.append((M * (-(-K // 32) * 32), x.dtype))
    elif not x.is_contiguous():
        specs.append((M * K, x.dtype))
    ptrs = poison(*specs, (M * N, x.dtype))
    out = kbit.matmul(x, qw, bias, grid_override=grid_override)
    poisoned(ptrs, out)
    return out


def _gemm_sweep(qw: kbit.QuantizedWeight, seed: int, ms, dtypes=GEMM_DTYPES, grid_override=0, **params) -> None:
    """kbit.matmul for every M and dtype (bias on every other M); collect failures, report all."""
    N, K = qw.shape
    chk = GemmChecker(qw)
    g = gen(seed + 1, "cuda")
    failures = []
    for dtype in dtypes:
        for i, M in enumerate(ms):
            use_bias = i % 2 == 1
            x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.float32).to(dtype)
            bias = torch.randn(N, generator=g, device="cuda", dtype=torch.float32).to(dtype) if use_bias else None
            out = run_matmul(x, qw, bias, grid_override=grid_override)
            if out.shape != (M, N) or out.dtype != dtype or not out.is_cuda:
                failures.append(f"dtype={_name(dtype)} M={M}: output {tuple(out.shape)} {out.dtype} {out.device}")
                continue
            st = chk.stats(x, bias, out)
            if not st["ok"]:
                failures.append(f"dtype={_name(dtype)} M={M} bias={use_bias}: {chk.describe(st)}")
    assert not failures, tag(seed, op="matmul", N=N, K=K, bits=qw.bits, **params) + "\n  " + "\n  ".join(failures)


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


# ----------------------------------------------------------------------------- warp-specialized kernel (sm_90a)
# gemm_ws.cuh, forced with KBIT_GEMM_PATH=ws at every M (32, 64, 128 or 256 tokens per tile, several passes past
# 128), through the fused op (grid_override = 1000: one CTA per SM, tiles split across CTAs where the cut falls inside
# them; never dequantize + cuBLAS). The planned grids of whole tiles: the two tests after it.
WS_MS = (1, 5, 17, 32, 33, 64, 65, 100, 128, 129, 256, 300, 1000)
WS_SHAPES = ((4096, 4096), (1000, 4128), (256, 40), (130, 4104), (1536, 2048), (72, 100), (14336, 4096))
needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                  reason="the warp-specialized GEMM and the k split are tested on compute capability 9.x")


# gemm.cuh with the warps splitting 32-row (16-row at 9-16 tokens) tiles' k-groups, forced with KBIT_GEMM_PATH=k_split
# up to 16 tokens (a k range that ends inside a step, tiles past N, one CTA per tile or a forced grid that splits tiles
# across CTAs).
K_SPLIT_MS = (1, 2, 3, 5, 8, 9, 13, 16)
FORCED_PATH_CASES = ([("ws", WS_MS, N, K) for N, K in WS_SHAPES] +
                     [("k_split", K_SPLIT_MS, N, K) for N, K in SMALL_SHAPES + MODEL_SHAPES])


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
        kp = formats.padded_in_features(K)
        chk = GemmChecker(qw)
        g = gen(seed + 1, "cuda")
        settled = ops.weights_settled(b, a, qw.codebook)
        cases = ((1, 0), (17, 7), (256, 0), (300, 3), (600, 64), (257, 1000), (1000, 0), (2560, 0))
        for i, (M, grid) in enumerate(cases):
            dtype = torch.bfloat16 if i % 3 == 2 else torch.float16
            x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
            bias = torch.randn(N, generator=g, device="cuda").to(dtype) if i % 2 else None
            y = ext.gemm(x, b, a, qw.codebook, qw.scale, bias, k, N, kp, grid, 32, 0, 1, 256, settled)
            st = chk.stats(x, bias, y)
            if not st["ok"]:
                failures.append(f"N={N} K={K} seed={seed} M={M} grid={grid} {_name(dtype)}: {chk.describe(st)}")
    assert not failures, tag(seed_for("gemm-ws256", k), op="gemm ws_tokens=256", bits=k) + "\n  " + "\n  ".join(failures)


# Tiles cut in parts on the planned grid (cut.h, ws_tile_parts; the parts named are those of 132 SMs), (tokens per
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
            y = ext.gemm(x, b, a, qw.codebook, qw.scale, bias, k, N, formats.padded_in_features(K), 0, tokens // 8, 0,
                         1, tokens, ops.weights_settled(b, a, qw.codebook))
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
    tiles of 256 rows, 4 whole tiles on each of 128 CTAs (gemm.cu, ws_whole_tiles_grid)."""
    from kbit._build import cuda_ext

    N, K, M = 4096, 4096, 4096
    seed = seed_for("gemm-ws-whole", k)
    qw = quantized_weight(N, K, k, seed)
    b, a = qw.gemm_layout()
    g = gen(seed + 1, "cuda")
    x = torch.randn(M, K, generator=g, device="cuda").half()
    bias = torch.randn(N, generator=g, device="cuda").half()
    y = cuda_ext().gemm(x, b, a, qw.codebook, qw.scale, bias, k, N, formats.padded_in_features(K), 0, 16, 0, 1, 128,
                        ops.weights_settled(b, a, qw.codebook))
    chk = GemmChecker(qw)
    st = chk.stats(x, bias, y)
    assert st["ok"], tag(seed, op="gemm ws_tokens=128, whole tiles", bits=k) + " " + chk.describe(st)


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


@pytest.mark.parametrize("N,K", ((384, 96), (1000, 4128), (4096, 4096), (1536, 2048)), ids=lambda v: str(v))
@pytest.mark.parametrize("k", BITS)
def test_gemm_custom_codebook(k, N, K):
    seed = seed_for("gemm-custom", k, N, K)
    qw = quantized_weight(N, K, k, seed, cb_kind="custom")
    _gemm_sweep(qw, seed, (1, 3, 16, 33, 100), codebook="custom")


@needs_hopper
@pytest.mark.parametrize("k", BITS)
def test_gemm_custom_codebook_forced_ws(k, monkeypatch):
    """The warp-specialized kernel with a random asymmetric codebook (its own pair tables), every tile width."""
    monkeypatch.setenv("KBIT_GEMM_PATH", "ws")
    for N, K in ((1000, 4128), (1536, 2048)):
        seed = seed_for("gemm-custom-ws", k, N, K)
        qw = quantized_weight(N, K, k, seed, cb_kind="custom")
        _gemm_sweep(qw, seed, (17, 33, 64, 100, 129), codebook="custom")


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


# ----------------------------------------------------------------------------- forced split-K
SPLITK_SHAPES = ((128, 4096), (1536, 2048), (4096, 14336))  # (N, K): 16, 8 and 56 k-groups
SPLITK_GRIDS = (1, 3, 7, 64, 132, 1000)  # 1000: more than the SMs, clamped to one CTA per SM
SPLITK_CASES = [(k, torch.float16) for k in BITS] + [(4, torch.bfloat16), (3, torch.bfloat16)]


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


# ----------------------------------------------------------------------------- CUDA graphs
def _capture(fn, warmup: int = 3, on_warmup_stream: bool = False):
    """Warm up on a side stream, then capture on torch's capture stream or on that same side stream (the
    GEMM's split-K workspace is cached per stream: the two take different paths)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s if on_warmup_stream else None):
        out = fn()
    return graph, out


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
    for N, K_dim in ((1000, 96), (128, 4128)):
        packed, absmax = random_storage(N * K_dim, k, seed)
        want_b, want_a = layout.repack_reference(packed, absmax, k, N, K_dim)
        got_b, got_a = ops.repack(packed.cuda(), absmax.cuda(), k, N, K_dim)
        msg = tag(seed, op="sanitize-repack", bits=k, N=N, K_dim=K_dim)
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
    k, N, K_dim = 4, 256, 512
    W = torch.randn(N, K_dim, device="cuda").half() * 0.02
    qw = kbit.quantize(W, k)
    b, a = qw.gemm_layout()
    cb, s, x = qw.codebook, qw.scale, torch.randn(3, K_dim, device="cuda").half()
    n = N * K_dim
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
        ("repack packed uint8", lambda: ext.repack(as_u8, qw.absmax, k, N, K_dim)),
        ("repack absmax int32", lambda: ext.repack(qw.packed, qw.absmax.int(), k, N, K_dim)),
        ("repack K_dim 50", lambda: ext.repack(qw.packed, qw.absmax, k, N, 50)),
        ("repack N larger", lambda: ext.repack(qw.packed, qw.absmax, k, N * 2, K_dim)),
        ("repack N negative", lambda: ext.repack(qw.packed, qw.absmax, k, -N, -K_dim)),
        ("gemm b_gemm int64", lambda: ext.gemm(x, b.long(), a, cb, s, None, k, N, K_dim, 0, *config)),
        ("gemm b_gemm short", lambda: ext.gemm(x, b[:-1], a, cb, s, None, k, N, K_dim, 0, *config)),
        ("gemm layout for a larger N", lambda: ext.gemm(x, b, a, cb, s, None, k, N * 4, K_dim, 0, *config)),
        ("gemm layout for a larger K", lambda: ext.gemm(x, b, a, cb, s, None, k, N, K_dim * 4, 0, *config)),
        ("gemm absmax float", lambda: ext.gemm(x, b, a.float(), cb, s, None, k, N, K_dim, 0, *config)),
        ("gemm codebook short", lambda: ext.gemm(x, b, a, cb[:4], s, None, k, N, K_dim, 0, *config)),
        ("gemm scale on cpu", lambda: ext.gemm(x, b, a, cb, s.cpu(), None, k, N, K_dim, 0, *config)),
        ("gemm bias short", lambda: ext.gemm(x, b, a, cb, s, torch.zeros(N - 1, device="cuda").half(), k, N, K_dim, 0,
                                             *config)),
        ("gemm bias bf16", lambda: ext.gemm(x, b, a, cb, s, torch.zeros(N, device="cuda").bfloat16(), k, N, K_dim, 0,
                                            *config)),
        ("gemm x too wide", lambda: ext.gemm(torch.randn(3, K_dim + 8, device="cuda").half(), b, a, cb, s, None, k, N,
                                             K_dim, 0, *config)),
        ("gemm k mismatch", lambda: ext.gemm(x, b, a, cb, s, None, 3, N, K_dim, 0, *config)),
        ("gemm configuration not built", lambda: ext.gemm(x, b, a, cb, s, None, k, N, K_dim, 0, 3, 0, 1, 0, False)),
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


# ----------------------------------------------------------------------------- harness report (keep last)
def test_poison_coverage():
    """Report how often the poisoned blocks really became the ops' outputs in this session.

    Low coverage is not a kernel bug (e.g. the op allocates a workspace before its outputs), but
    it means unwritten outputs would be caught only through mismatches, not NaNs: warn about it.
    """
    calls, hits = _POISON_STATS["calls"], _POISON_STATS["hits"]
    if calls == 0:
        pytest.skip("no poisoned op calls ran in this session")
    print(f"poisoned memory reached the op outputs in {hits} of {calls} calls")
    if hits < 0.9 * calls:
        warnings.warn(f"kbit test harness: poisoned memory reached the op outputs in only {hits} of {calls} calls "
                      "(does an op allocate scratch memory before its outputs?)")
