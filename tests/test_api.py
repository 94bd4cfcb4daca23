"""High-level API: kbit.quantize / dequantize / matmul, QuantizedWeight, save/load, bad inputs."""

from __future__ import annotations

import io

import re

import pytest
import torch

import kbit
import kbit.functional
from kbit.weight import padded_in_features

from test_formats import DTYPES, KS, SQNR_DB, _name, assert_block_bound, sqnr_db

GEMM_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def random_shape():
    N = int(torch.randint(1, 300, ()))
    K = int(torch.randint(1, 300, ()))
    return N, K


def assert_rows_bound(W, W_hat, qw, what=""):
    """Blocks never cross rows: check the bound on the [N, K_pad] matrix, row blocks of 32."""
    N, K = W.shape
    in_features_padded = padded_in_features(K)
    pad = lambda t: torch.nn.functional.pad(t.to(torch.float32), (0, in_features_padded - K))  # noqa: E731
    # A block 2**14..2**19 times smaller than the largest (a row's last block may hold one tiny weight) falls into
    # E4M4's subnormal range: its absolute error stays under about one subnormal step, 2**-19 of the top, and
    # kbit.PrecisionWarning reports it (tests/test_untrusted.py).
    assert_block_bound(pad(W), pad(W_hat), qw.codebook, eps_abs=2.0**-18 * float(W.abs().max()), what=what)


def reference_matmul(x, qw, bias=None):
    y = x.to(torch.float32) @ kbit.dequantize(qw, torch.float32).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y


def assert_close_out(y, ref, dtype, what=""):
    assert y.dtype == dtype, what
    assert y.shape == ref.shape, f"{what}: shape {tuple(y.shape)} != {tuple(ref.shape)}"
    tol = GEMM_TOL[dtype]
    torch.testing.assert_close(y.to(torch.float32), ref, rtol=tol, atol=tol * (1 + float(ref.abs().max()) if ref.numel() else 1),
                               msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------- quantize / dequantize
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_quantize_any_shape(k, dtype):
    for _ in range(3):
        N, K = random_shape()
        W = torch.randn(N, K).to(dtype)
        qw = kbit.quantize(W, bits=k)
        what = f"bits={k} dtype={_name(dtype)} shape=({N}, {K})"
        assert isinstance(qw, kbit.QuantizedWeight)
        assert qw.shape == (N, K) and qw.bits == k and qw.dtype == dtype, what
        assert qw.in_features == K and qw.out_features == N
        assert qw.packed.dtype == torch.int32 and qw.absmax.dtype == torch.uint8
        assert qw.codebook.dtype == torch.float32 and qw.scale.dtype == torch.float32 and qw.scale.dim() == 0
        W_hat = kbit.dequantize(qw)
        assert W_hat.shape == (N, K) and W_hat.dtype == dtype, what
        assert W_hat.is_contiguous()
        assert_rows_bound(W, W_hat, qw, what)
        for out in DTYPES:
            assert torch.equal(kbit.dequantize(qw, out), kbit.dequantize(qw, torch.float32).to(out)), what


@pytest.mark.parametrize("k", KS)
def test_quantize_sqnr_on_weight_matrix(k):
    W = torch.randn(1024, 1024) * 0.02
    qw = kbit.quantize(W, bits=k)
    s = sqnr_db(W, kbit.dequantize(qw))
    assert s > SQNR_DB[k], f"bits={k}: {s:.2f} dB"


def test_quantize_matches_low_level_format():
    # kbit.quantize stores the [N, K_pad] matrix (zero columns appended) in the seeds' format.
    N, K = 37, 70
    W = torch.randn(N, K)
    qw = kbit.quantize(W, bits=3)
    Wp = torch.nn.functional.pad(W, (0, padded_in_features(K) - K))
    packed, absmax, cb = kbit.functional.quantize_kbit(Wp, 3, scale=qw.scale)
    assert torch.equal(packed, qw.packed) and torch.equal(absmax, qw.absmax) and torch.equal(cb, qw.codebook)


def test_quantize_custom_codebook_and_special_inputs():
    cb = torch.linspace(-1, 1, 8)
    W = torch.randn(64, 96)
    qw = kbit.quantize(W, bits=3, codebook=cb)
    assert torch.equal(qw.codebook, cb)
    assert qw.codebook.data_ptr() != cb.data_ptr(), "the weight must own its codebook"
    assert kbit.quantize(W, bits=3).codebook.data_ptr() != kbit.quantize(W, bits=3).codebook.data_ptr()
    assert_rows_bound(W, kbit.dequantize(qw), qw, "uniform codebook")
    # Zeros, a requires_grad weight and a non-contiguous weight.
    assert bool((kbit.dequantize(kbit.quantize(torch.zeros(8, 40))) == 0).all())
    Wg = torch.randn(16, 64, requires_grad=True)
    assert not kbit.dequantize(kbit.quantize(Wg)).requires_grad
    Wt = torch.randn(96, 64).T
    assert torch.equal(kbit.dequantize(kbit.quantize(Wt, bits=4)), kbit.dequantize(kbit.quantize(Wt.contiguous(), bits=4)))


def test_quantized_weight_properties():
    qw = kbit.quantize(torch.randn(128, 256, dtype=torch.float16), bits=4)
    assert qw.device == torch.device("cpu")
    # 4 bits + one E4M4 byte per 32 weights (+ codebook and scale, amortized).
    assert 4.25 <= qw.bits_per_weight < 4.27
    assert qw.nbytes == 128 * 256 // 32 * 4 * 4 + 128 * 256 // 32 + 16 * 4 + 4
    r = repr(qw)
    assert "QuantizedWeight" in r and "bits=4" in r and "(128, 256)" in r and "float16" in r


# ----------------------------------------------------------------------------- matmul
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_matmul_matches_dequantize_reference(k, dtype):
    N, K = random_shape()
    qw = kbit.quantize(torch.randn(N, K), bits=k)
    bias = torch.randn(N).to(dtype)
    for lead in [(1,), (int(torch.randint(2, 20, ())),), (2, 3), ()]:
        x = torch.randn(*lead, K).to(dtype)
        what = f"bits={k} dtype={_name(dtype)} N={N} K={K} x={tuple(x.shape)}"
        assert_close_out(kbit.matmul(x, qw), reference_matmul(x, qw), dtype, what)
        assert_close_out(kbit.matmul(x, qw, bias=bias), reference_matmul(x, qw, bias), dtype, what + " +bias")


def test_matmul_empty_batches():
    qw = kbit.quantize(torch.randn(48, 64), bits=4)
    for shape in [(0, 64), (2, 0, 64), (0, 3, 64)]:
        for dtype in DTYPES:
            y = kbit.matmul(torch.randn(shape).to(dtype), qw, bias=torch.randn(48))
            assert y.shape == shape[:-1] + (48,) and y.dtype == dtype


def test_matmul_noncontiguous_input():
    qw = kbit.quantize(torch.randn(40, 64), bits=5)
    x = torch.randn(64, 10).T
    torch.testing.assert_close(kbit.matmul(x, qw), kbit.matmul(x.contiguous(), qw))


@pytest.mark.parametrize("k", KS)
def test_matmul_close_to_unquantized(k):
    # End to end: the output's relative error is about the weight's (SQNR thresholds as amplitudes).
    W = torch.randn(256, 512) * 0.02
    x = torch.randn(8, 512)
    y = kbit.matmul(x, kbit.quantize(W, bits=k))
    ref = x @ W.T
    rel = float((y - ref).norm() / ref.norm())
    assert rel < 10 ** (-SQNR_DB[k] / 20), f"bits={k}: relative output error {rel:.4f}"


def test_kbit_gemm_and_gemm_layout_on_cpu():
    N, K = 200, 96
    qw = kbit.quantize(torch.randn(N, K), bits=4)
    b, a = qw.gemm_layout()
    assert qw.gemm_layout()[0] is b, "the GEMM layout must be cached"
    x = torch.randn(5, K, dtype=torch.float16)
    y = kbit.functional.kbit_gemm(x, b, a, qw.codebook, 4, N, K, scale=qw.scale)
    assert_close_out(y, reference_matmul(x, qw), torch.float16, "kbit_gemm")
    b2, a2 = kbit.functional.repack_for_gemm(qw.packed, qw.absmax, 4, N, K)
    assert torch.equal(b, b2) and torch.equal(a, a2)
    moved = qw.to("cpu")
    assert moved.gemm_layout()[0].shape == b.shape


# ----------------------------------------------------------------------------- save / load / devices
def _assert_same_qw(a: kbit.QuantizedWeight, b: kbit.QuantizedWeight):
    assert a.shape == b.shape and a.bits == b.bits and a.dtype == b.dtype
    for name in ("packed", "absmax", "codebook", "scale"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(kbit.dequantize(a), kbit.dequantize(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_quantized_weight_torch_save_round_trip(dtype):
    N, K = random_shape()
    k = int(torch.randint(2, 6, ()))
    qw = kbit.quantize(torch.randn(N, K).to(dtype), bits=k)
    state = qw.state_dict(prefix="layer.")
    assert set(state) == {f"layer.{n}" for n in kbit.weight.STATE_KEYS}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    _assert_same_qw(qw, kbit.QuantizedWeight.from_state_dict(loaded, prefix="layer."))


def test_quantized_weight_safetensors_round_trip(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    qws = {f"l{i}.": kbit.quantize(torch.randn(*random_shape()).to(d), bits=k) for i, (d, k) in
           enumerate([(torch.float16, 2), (torch.bfloat16, 3), (torch.float32, 4), (torch.float16, 5)])}
    state = {}
    for prefix, qw in qws.items():
        state.update(qw.state_dict(prefix=prefix))
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file(state, str(path))
    loaded = safetensors_torch.load_file(str(path))
    for prefix, qw in qws.items():
        _assert_same_qw(qw, kbit.QuantizedWeight.from_state_dict(loaded, prefix=prefix))


def test_from_state_dict_errors():
    qw = kbit.quantize(torch.randn(32, 64))
    state = qw.state_dict()
    with pytest.raises(ValueError, match="lacks packed"):
        kbit.QuantizedWeight.from_state_dict({k: v for k, v in state.items() if k != "packed"})
    bad = dict(state, packed=state["packed"][:-1])
    with pytest.raises(ValueError, match=r"packed of a bits=4 \[32, 64\] weight .* must have shape"):
        kbit.QuantizedWeight.from_state_dict(bad)


def test_quantized_weight_to_device():
    qw = kbit.quantize(torch.randn(64, 96), bits=3)
    m = qw.to("meta")
    assert m.device.type == "meta" and m.shape == qw.shape and m.bits == 3
    assert all(t.device.type == "meta" for t in (m.packed, m.absmax, m.codebook, m.scale))
    back = qw.to(torch.device("cpu"))
    _assert_same_qw(qw, back)
    _assert_same_qw(qw, qw.cpu())
    # matmul on the meta device gives shapes only (what torch.compile's fake tensors see).
    y = kbit.matmul(torch.randn(3, 96, device="meta"), m)
    assert y.shape == (3, 64) and y.device.type == "meta"


# ----------------------------------------------------------------------------- bad inputs
def _w():
    return torch.randn(64, 96)


BAD_QUANTIZE = [
    ("float64 weight", lambda: kbit.quantize(_w().double()), TypeError, r"W must have dtype"),
    ("int weight", lambda: kbit.quantize(_w().to(torch.int32)), TypeError, r"W must have dtype"),
    ("not a tensor", lambda: kbit.quantize([[1.0, 2.0]]), TypeError, r"W must be a torch.Tensor"),
    ("bits=1", lambda: kbit.quantize(_w(), bits=1), ValueError, r"bits must be one of"),
    ("bits=6", lambda: kbit.quantize(_w(), bits=6), ValueError, r"bits must be one of"),
    ("k float", lambda: kbit.quantize(_w(), bits=4.0), TypeError, r"bits must be an int"),
    ("k bool", lambda: kbit.quantize(_w(), bits=True), TypeError, r"bits must be an int"),
    ("codebook length", lambda: kbit.quantize(_w(), bits=4, codebook=torch.linspace(-1, 1, 8)), ValueError,
     r"codebook for bits=4 must be 1-D with 16 entries"),
    ("codebook 2-D", lambda: kbit.quantize(_w(), bits=2, codebook=torch.linspace(-1, 1, 4).reshape(2, 2)), ValueError,
     r"codebook for bits=2"),
    ("codebook unsorted", lambda: kbit.quantize(_w(), bits=3, codebook=torch.linspace(1, -1, 8)), ValueError,
     r"sorted strictly ascending"),
    ("codebook duplicate", lambda: kbit.quantize(_w(), bits=2, codebook=torch.tensor([-1.0, 0.0, 0.0, 1.0])),
     ValueError, r"sorted strictly ascending"),
    ("codebook out of [-1, 1]", lambda: kbit.quantize(_w(), bits=2, codebook=torch.tensor([-2.0, 0.0, 0.5, 1.0])),
     ValueError, r"\[-1, 1\]"),
    ("codebook NaN", lambda: kbit.quantize(_w(), bits=2, codebook=torch.tensor([-1.0, float("nan"), 0.5, 1.0])),
     ValueError, r"NaN or Inf"),
    ("codebook int", lambda: kbit.quantize(_w(), bits=2, codebook=torch.tensor([-2, 0, 1, 2])), TypeError,
     r"floating-point"),
    ("weight NaN", lambda: kbit.quantize(_w().index_fill(0, torch.tensor([3]), float("nan"))), ValueError,
     r"W contains 96 NaN/Inf"),
    ("weight Inf", lambda: kbit.quantize(_w().index_fill(1, torch.tensor([5]), float("-inf"))), ValueError,
     r"W contains 64 NaN/Inf"),
    ("fp16 weight Inf", lambda: kbit.quantize(_w().half().index_fill(0, torch.tensor([0]), float("inf"))),
     ValueError, r"NaN/Inf"),
    ("weight 1-D", lambda: kbit.quantize(torch.randn(96)), ValueError, r"2-D \[out_features, in_features\]"),
    ("weight 3-D", lambda: kbit.quantize(torch.randn(2, 3, 96)), ValueError, r"2-D \[out_features, in_features\]"),
    ("weight empty", lambda: kbit.quantize(torch.randn(0, 96)), ValueError, r"non-empty"),
    ("weight on meta", lambda: kbit.quantize(torch.randn(64, 96, device="meta")), ValueError, r"meta device"),
    ("low-level NaN", lambda: kbit.functional.quantize_kbit(torch.tensor([1.0, float("nan")])), ValueError, r"A contains 1"),
    ("low-level float64", lambda: kbit.functional.quantize_kbit(torch.randn(10, dtype=torch.float64)), TypeError,
     r"A must have dtype"),
    ("low-level k", lambda: kbit.functional.quantize_kbit(torch.randn(10), bits=7), ValueError, r"bits must be one of"),
]


@pytest.mark.parametrize("case", BAD_QUANTIZE, ids=[c[0] for c in BAD_QUANTIZE])
def test_bad_quantize_inputs(case):
    _, fn, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        fn()


def _qw():
    return kbit.quantize(torch.randn(64, 96), bits=4)


BAD_MATMUL = [
    ("x wrong K", lambda qw: kbit.matmul(torch.randn(3, 95), qw), ValueError, r"x must have shape \[\.\.\., 96\]"),
    ("x transposed", lambda qw: kbit.matmul(torch.randn(96, 3), qw), ValueError, r"x must have shape"),
    ("x scalar", lambda qw: kbit.matmul(torch.tensor(1.0), qw), ValueError, r"x must have shape"),
    ("x float64", lambda qw: kbit.matmul(torch.randn(3, 96, dtype=torch.float64), qw), TypeError,
     r"x must have dtype"),
    ("x int", lambda qw: kbit.matmul(torch.ones(3, 96, dtype=torch.int64), qw), TypeError, r"x must have dtype"),
    ("x not a tensor", lambda qw: kbit.matmul([[1.0] * 96], qw), TypeError, r"x must be a torch.Tensor"),
    ("weight not quantized", lambda qw: kbit.matmul(torch.randn(3, 96), torch.randn(64, 96)), TypeError,
     r"qw must be a kbit.QuantizedWeight"),
    ("x on meta", lambda qw: kbit.matmul(torch.randn(3, 96, device="meta"), qw), ValueError,
     r"x is on meta but the weight is on cpu"),
    ("weight on meta", lambda qw: kbit.matmul(torch.randn(3, 96), qw.to("meta")), ValueError,
     r"x is on cpu but the weight is on meta"),
    ("bias shape", lambda qw: kbit.matmul(torch.randn(3, 96), qw, torch.randn(63)), ValueError,
     r"bias must have shape \(64,\)"),
    ("bias device", lambda qw: kbit.matmul(torch.randn(3, 96), qw, torch.randn(64, device="meta")), ValueError,
     r"bias is on meta"),
    ("dequantize dtype", lambda qw: kbit.dequantize(qw, torch.int8), TypeError, r"dtype must have dtype"),
    ("dequantize float64", lambda qw: kbit.dequantize(qw, torch.float64), TypeError, r"dtype must have dtype"),
    ("dequantize not qw", lambda qw: kbit.dequantize(torch.randn(3)), TypeError, r"kbit.QuantizedWeight"),
    ("dequantize_kbit n", lambda qw: kbit.functional.dequantize_kbit(qw.packed, qw.absmax, qw.codebook, 4, 5000), ValueError,
     r"5000 elements at bits=4 need"),
    ("dequantize_kbit k", lambda qw: kbit.functional.dequantize_kbit(qw.packed, qw.absmax, qw.codebook, 3, 64 * 96),
     ValueError, r"codebook for bits=3|bits=3 need"),
    ("dequantize_kbit packed dtype", lambda qw: kbit.functional.dequantize_kbit(qw.packed.long(), qw.absmax, qw.codebook, 4,
                                                                     64 * 96), TypeError, r"packed must be int32"),
    ("dequantize_kbit absmax dtype", lambda qw: kbit.functional.dequantize_kbit(qw.packed, qw.absmax.float(), qw.codebook, 4,
                                                                     64 * 96), TypeError, r"absmax must be uint8"),
    ("dequantize_kbit device", lambda qw: kbit.functional.dequantize_kbit(qw.packed.to("meta"), qw.absmax, qw.codebook, 4,
                                                               64 * 96), ValueError, r"one device"),
    ("dequantize_kbit codebook", lambda qw: kbit.functional.dequantize_kbit(qw.packed, qw.absmax, qw.codebook.flip(0), 4,
                                                                 64 * 96), ValueError, r"sorted"),
    ("kbit_gemm layout shape", lambda qw: kbit.functional.kbit_gemm(torch.randn(2, 96).half(), qw.packed, qw.absmax,
                                                         qw.codebook, 4, 64, 96), ValueError, r"GEMM layout"),
    ("kbit_gemm x dtype", lambda qw: kbit.functional.kbit_gemm(torch.randn(2, 96, dtype=torch.float64), *qw.gemm_layout(),
                                                    qw.codebook, 4, 64, 96), TypeError, r"A must have dtype"),
    ("kbit_gemm K", lambda qw: kbit.functional.kbit_gemm(torch.randn(2, 128).half(), *qw.gemm_layout(), qw.codebook, 4, 64,
                                              96), ValueError, r"K <= in_features_padded"),
    ("repack in_features_padded", lambda qw: kbit.functional.repack_for_gemm(qw.packed, qw.absmax, 4, 96, 64 + 1),
     ValueError, r"multiple of 32"),
    ("repack storage size", lambda qw: kbit.functional.repack_for_gemm(qw.packed, qw.absmax, 4, 32, 96), ValueError,
     r"need"),
]


@pytest.mark.parametrize("case", BAD_MATMUL, ids=[c[0] for c in BAD_MATMUL])
def test_bad_matmul_inputs(case):
    _, fn, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        fn(_qw())


def test_bad_input_never_a_wrong_result_for_mismatched_k_dim():
    # A weight quantized at K=96 must not accept x with K=128 even though 96 and 128 pad differently.
    qw = kbit.quantize(torch.randn(10, 70), bits=4)
    with pytest.raises(ValueError):
        kbit.matmul(torch.randn(2, 96), qw)  # 70 pads to 96 internally; the caller's K must still be 70


# ----------------------------------------------------------------------------- command line
def test_cli_demo_small(capsys):
    from kbit.__main__ import main

    rc = main(["demo", "--layers", "1", "--hidden", "128", "--intermediate", "352", "--bits", "2", "5",
               "--repeats", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| bits | bits/weight |" in out and "M=1 fp32 µs" in out and "M=16 speedup" in out
    rows = [line for line in out.splitlines() if line.startswith("| 2 |") or line.startswith("| 5 |")]
    assert len(rows) == 2, out
    # CPU: the kernel sums in another order than x @ dequantize(W).T, so they agree to float32 rounding
    worst = re.search(r"worst relative error ([0-9.e+-]+)", out)
    assert worst and float(worst.group(1)) < 1e-5, out


def test_demo_results():
    import io as _io

    from kbit import demo

    res = demo.run(bits=(2, 3, 4, 5), layers=1, hidden=64, intermediate=160, device="cpu", repeats=1,
                   out=_io.StringIO())
    for row in res:
        k = row["bits"]
        assert k + 0.25 <= row["bits_per_weight"] < k + 0.5, row  # + codebooks of a tiny model
        assert row["sqnr_db"] > SQNR_DB[k], row
        assert row["saved_bytes"] > 0 and row["kbit_us_m1"] > 0 and row["ref_us_m16"] > 0


def test_cli_info(capsys):
    import json

    from kbit.__main__ import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out and "cuda_extension_built" in out
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__ and info["cuda_available"] == torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cli_build_without_cuda(capsys):
    from kbit.__main__ import main

    assert main(["build"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_cli_quantize_dispatch(monkeypatch, capsys):
    import sys
    import types

    from kbit.__main__ import main

    seen = []
    fake = types.ModuleType("kbit.convert")
    fake.cli_quantize = lambda argv: seen.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "kbit.convert", fake)
    assert main(["quantize", "some/model", "--bits", "3", "--out", "o"]) == 0
    assert seen == [["some/model", "--bits", "3", "--out", "o"]]
    monkeypatch.setitem(sys.modules, "kbit.convert", None)  # as if kbit.convert were missing
    assert main(["quantize", "m", "--out", "o"]) == 2
    assert "kbit.convert" in capsys.readouterr().err


def test_cli_usage_errors(capsys):
    from kbit.__main__ import main

    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["demo", "--bits", "7"])
    with pytest.raises(SystemExit):
        main(["nonsense"])


def test_python_dash_m_kbit_runs():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kbit", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "demo" in r.stdout and "quantize" in r.stdout
