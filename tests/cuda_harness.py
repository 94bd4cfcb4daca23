"""What the CUDA test files share: seeds, poisoned outputs, bitwise comparison, the GEMM tolerance, capture.

What is checked, against the pure-PyTorch reference in ``kbit.formats`` / ``kbit.layout``:

* ``kbit::quantize``, ``kbit::dequantize`` and ``kbit::repack`` on CUDA are bit-exact, for every
  K, every input/output dtype, sizes that are and are not multiples of the block / tile sizes,
  default and custom codebooks, per-tensor scales != 1, and ties on codebook midpoints (test_cuda_formats.py).
* The fused GEMM (``kbit.matmul``) is within a tolerance derived from a same-precision PyTorch
  computation, as flash-attention tests do (``GemmChecker``): with ``ref32`` = fp32 product of the fp32
  dequantized weight and ``ref_lp`` = ``F.linear`` in the input dtype on the same GPU,
  ``max|out - ref32| <= 2 * max|ref_lp - ref32| + atol`` (atol = half an output ulp at the largest
  |ref32| + 1e-5 * max|ref32|: one output rounding step is inherent) and
  ``rel_fro(out) <= 2 * rel_fro(ref_lp) + 1e-5``. Every K, fp16 and bf16, M in {1, 2, 3, 5, 16,
  17, 31, 33, 64, 100, 256}, odd shapes and the seeds' model shapes, custom codebooks, bias,
  leading batch dims, M = 0, K % 32 != 0 (test_cuda_gemm.py; each fused kernel forced: test_cuda_gemm_paths.py).
* Forced split-K (``grid_override=g``) is deterministic: 200 repeats give bitwise identical results
  (test_cuda_split_k.py).
* CUDA-graph capture and ``torch.compile(fullgraph=True)`` of the ops and of ``KbitLinear`` (test_cuda_capture.py).
* ``test_sanitize_*``: small, fast tests for ``compute-sanitizer`` (memcheck, racecheck); select
  them with ``-k sanitize`` (test_cuda_sanitize.py). They avoid cuBLAS and compare against CPU references.

Every run draws fresh random inputs from a session seed printed in every failure message; set
``KBIT_TEST_SEED=<seed>`` to replay a run. Outputs are poisoned before every kernel call: right
before the call, buffers of the outputs' sizes are allocated (in the op's allocation order),
filled with 0xFF bytes (NaN for floating outputs) and freed, so PyTorch's caching allocator hands
exactly that memory to the op; any element the kernel fails to write then shows up as a
mismatch or a NaN (test_cuda_harness.py reports how often that memory reached the outputs).
"""

from __future__ import annotations

import math
import os
import random
import zlib

import pytest
import torch
import torch.nn.functional as F

import kbit
import kbit.functional
from kbit import formats
from kbit._validate import check_codebook

SESSION_SEED = int(os.environ.get("KBIT_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
SPLITK_REPS = int(os.environ.get("KBIT_SPLITK_REPS", "200"))

BITS = (2, 3, 4, 5)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GEMM_DTYPES = (torch.float16, torch.bfloat16)
SIZES = (1, 31, 32, 33, 1000, 8192 * 2 + 32 * 77, 8192 * 3 + 17, 1 << 20)
GEMM_MS = (1, 2, 3, 5, 16, 17, 31, 33, 64, 100, 160, 256)

# (N_out, K_in). Small odd shapes: N not a multiple of 128, K not a multiple of 256 (partial
# k-groups), K % 32 != 0 with K % 8 == 0 (x narrower than the layout's in_features_padded) and K % 8 != 0
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


needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                  reason="the warp-specialized GEMM and the k split are tested on compute capability 9.x")


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
