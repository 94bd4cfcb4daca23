"""Untrusted checkpoints and bad input: a clear TypeError/ValueError (or, through ``load_state_dict``, PyTorch's
RuntimeError listing ours), or a correct result; never a silently wrong answer, never Inf from finite weights.

Property-based: hypothesis draws dtypes, shapes, values and missing/extra keys. The GPU side (the binding's own
checks under compute-sanitizer) is in tests/test_cuda_sanitize.py (``test_sanitize_malformed_*``).
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from torch import nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kbit  # noqa: E402
import kbit.functional  # noqa: E402
from kbit.formats import STATE_KEYS, dequantize_reference  # noqa: E402

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False)
DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]
CLEAR = (TypeError, ValueError)


def _valid_state(bits=3, N=24, K=70, dtype=torch.float16):
    W = (torch.randn(N, K) * 0.02).to(dtype)
    return kbit.quantize(W, bits=bits).state_dict(), W


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same elements in another dtype (what a crafted checkpoint stores), or the same bytes reinterpreted."""
    if dtype == torch.bool:
        return t != 0
    return t.to(dtype)


# A mutation of one entry of a valid state dict: (description, function of the entry -> new entry or None to drop).
def _mutations():
    def reshape_same_numel(t):
        return t.reshape(1, -1) if t.dim() else t.reshape(1)

    def shrink(t):
        return t.reshape(-1)[:-1].clone() if t.numel() > 1 else t.reshape(-1)[:0].clone()

    def grow(t):
        return torch.cat([t.reshape(-1), t.reshape(-1)[:1]])

    def reverse(t):
        return t.flip(0) if t.dim() else t

    def nan(t):
        return torch.full_like(t, float("nan")) if t.is_floating_point() else t

    def inf(t):
        return torch.full_like(t, float("inf")) if t.is_floating_point() else t

    def halve(t):
        return t * 0.5 if t.is_floating_point() else t // 2

    def negate(t):
        return -t if t.dtype != torch.bool and t.dtype != torch.uint8 else t

    def times3(t):
        return t * 3

    def strided(t):
        return torch.stack([t, t], -1).reshape(-1)[::2] if t.dim() == 1 else t

    fns = {"drop": lambda t: None, "reshape": reshape_same_numel, "shrink": shrink, "grow": grow,
           "reverse": reverse, "nan": nan, "inf": inf, "halve": halve, "negate": negate, "times3": times3,
           "strided": strided, "zero": torch.zeros_like}
    fns.update({f"as_{str(d).replace('torch.', '')}": (lambda d: lambda t: _cast(t, d))(d) for d in DTYPES})
    return fns


MUTATIONS = _mutations()


@st.composite
def mutated_states(draw):
    k = draw(st.sampled_from([2, 3, 4, 5]))
    N = draw(st.integers(1, 40))
    K = draw(st.integers(1, 100))
    state, W = _valid_state(k, N, K)
    plan = draw(st.lists(st.tuples(st.sampled_from(STATE_KEYS + ("extra",)), st.sampled_from(sorted(MUTATIONS))),
                         min_size=1, max_size=3))
    for key, name in plan:
        if key == "extra":
            state["extra"] = torch.zeros(3)
            continue
        if key not in state:
            continue
        new = MUTATIONS[name](state[key])
        if new is None:
            del state[key]
        else:
            state[key] = new
    return state, W, plan, k


def _assert_valid_weight(qw: kbit.QuantizedWeight):
    """What loading promises: the format's dtypes and shapes, a valid codebook and scale, finite output."""
    assert qw.packed.dtype == torch.int32 and qw.absmax.dtype == torch.uint8
    cb, s = qw.codebook, float(qw.scale)
    assert bool(torch.isfinite(cb).all()) and bool((cb[1:] > cb[:-1]).all()) and abs(float(cb.abs().max()) - 1) < 1e-6
    assert s > 0 and math.isfinite(s) and math.frexp(s)[0] == 0.5
    w = qw.dequantize(torch.float32)
    assert w.shape == qw.shape and bool(torch.isfinite(w).all())
    N, K = qw.shape
    ref = dequantize_reference(qw.packed, qw.absmax, qw.codebook, qw.bits, qw.packed.numel() // qw.bits * 32,
                               torch.float32, qw.scale).reshape(N, -1)[:, :K]
    assert torch.equal(w, ref)


@pytest.mark.slow  # fuzzing: CI runs it (-m slow)
@FUZZ
@given(mutated_states())
def test_fuzz_quantized_weight_from_state_dict(case):
    state, W, plan, k = case
    try:
        qw = kbit.QuantizedWeight.from_state_dict(state)
    except CLEAR:
        return
    _assert_valid_weight(qw)


@pytest.mark.slow  # fuzzing: CI runs it (-m slow)
@FUZZ
@given(mutated_states())
def test_fuzz_kbit_linear_load_state_dict(case):
    state, W, plan, k = case
    N, K = W.shape
    layer = kbit.KbitLinear(K, N, bias=False, bits=k, dtype=torch.float16)
    try:
        layer.load_state_dict(state, strict=bool(plan[0][1] != "drop"))
    except CLEAR:
        return
    except RuntimeError as e:  # load_state_dict's own error, which lists ours
        assert "Error(s) in loading state_dict" in str(e)
        # torch reports missing/unexpected keys after copying the rest; whatever it copied passed our checks.
        _assert_valid_weight(layer.qweight)
        return
    _assert_valid_weight(layer.qweight)
    y = layer(torch.randn(2, K, dtype=torch.float16))
    assert bool(torch.isfinite(y).all())


@pytest.mark.slow  # fuzzing: CI runs it (-m slow)
@FUZZ
@given(
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    st.integers(1, 24), st.integers(1, 80), st.sampled_from([2, 3, 4, 5]),
    st.sampled_from(["normal", "outlier", "max", "tiny", "zeros", "nan", "inf", "mixed_scales"]),
)
def test_fuzz_quantize(dtype, N, K, k, kind):
    W = torch.randn(N, K) * 0.02
    finfo = torch.finfo(dtype)
    if kind == "outlier":
        W[0, 0] = 1e4
    elif kind == "max":
        W[-1, -1] = finfo.max
        W[0, 0] = -finfo.max
    elif kind == "tiny":
        W = W * 1e-30
    elif kind == "zeros":
        W.zero_()
    elif kind == "nan":
        W[N // 2, K // 2] = float("nan")
    elif kind == "inf":
        W[0, -1] = float("-inf")
    elif kind == "mixed_scales":
        W[: N // 2] *= 1e-6
    W = W.to(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            qw, loss = kbit.weight.quantize_with_report(W, bits=k)
        except CLEAR:
            assert not bool(torch.isfinite(W).all()), "finite weights must quantize"
            return
    W_hat = qw.dequantize()
    assert bool(torch.isfinite(W_hat).all()), "finite weights must dequantize to finite values"
    assert not [w for w in caught if issubclass(w.category, kbit.PrecisionWarning)]  # the report, not a warning
    # The report is exact: recount the blocks beyond the bound from the result.
    Wp = torch.nn.functional.pad(W.float(), (0, qw.packed.numel() // qw.bits * 32 // N - K)).reshape(-1, 32)
    Wh = torch.nn.functional.pad(qw.dequantize(torch.float32), (0, Wp.numel() // N - K)).reshape(-1, 32)
    cb = qw.codebook
    amax = Wp.abs().amax(1)
    bound = (float((cb[1:] - cb[:-1]).max()) / 2 + 1 / 16) * amax + 1e-6 * amax + torch.finfo(torch.float32).tiny
    assert loss.beyond_bound == int(((Wp - Wh).abs().amax(1) > bound).sum())
    if kind in ("normal", "zeros"):
        assert loss.beyond_bound == 0 and loss.saturated == 0


# ----------------------------------------------------------------------------- the format's values
def _state_with(**changes):
    state, _ = _valid_state(bits=2)
    state.update(changes)
    return state


@pytest.mark.parametrize("name,changes,error,match", [
    ("codebook NaN", dict(codebook=torch.tensor([-1.0, float("nan"), 0.5, 1.0])), ValueError, "NaN"),
    ("codebook unsorted", dict(codebook=torch.tensor([-1.0, 0.5, -0.5, 1.0])), ValueError, "ascending"),
    ("codebook max 0.5", dict(codebook=torch.tensor([-0.5, -0.1, 0.1, 0.5])), ValueError, "largest"),
    ("codebook int", dict(codebook=torch.tensor([-1, 0, 1, 2])), TypeError, "float"),
    ("scale NaN", dict(scale=torch.tensor(float("nan"))), ValueError, "power of two"),
    ("scale Inf", dict(scale=torch.tensor(float("inf"))), ValueError, "power of two"),
    ("scale negative", dict(scale=torch.tensor(-0.25)), ValueError, "power of two"),
    ("scale 3", dict(scale=torch.tensor(3.0)), ValueError, "power of two"),
    ("scale int", dict(scale=torch.tensor(2)), TypeError, "float"),
    ("meta 3 elements", dict(meta=torch.tensor([2, 24, 70])), ValueError, r"shape \(4,\)"),
    ("meta float", dict(meta=torch.tensor([2.0, 24.0, 70.0, 0.0])), TypeError, "integer"),
    ("meta negative shape", dict(meta=torch.tensor([2, -24, 70, 0])), ValueError, "positive"),
    ("meta zero shape", dict(meta=torch.tensor([2, 0, 70, 0])), ValueError, "positive"),
    ("meta dtype code", dict(meta=torch.tensor([2, 24, 70, 7])), ValueError, "dtype code"),
    ("meta bits", dict(meta=torch.tensor([6, 24, 70, 0])), ValueError, "bits must be one of"),
])
def test_bad_format_values(name, changes, error, match):
    with pytest.raises(error, match=match):
        kbit.QuantizedWeight.from_state_dict(_state_with(**changes))
    layer = kbit.KbitLinear(70, 24, bias=False, bits=2)
    with pytest.raises((RuntimeError, error), match=match):
        layer.load_state_dict(_state_with(**changes))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.float32, torch.int64])
def test_packed_of_another_dtype_with_the_same_element_count(dtype, tmp_path):
    """The report's exploit: packed re-stored as another dtype with the same element count must not load."""
    state, _ = _valid_state(bits=4)
    bad = dict(state, packed=state["packed"].to(dtype))
    with pytest.raises(TypeError, match="packed must be int32"):
        kbit.QuantizedWeight.from_state_dict(bad)
    layer = kbit.KbitLinear(70, 24, bias=False, bits=4)
    with pytest.raises(RuntimeError, match="packed must be int32"):
        layer.load_state_dict(bad)
    model = nn.Sequential(nn.Linear(70, 24, bias=False))
    model = kbit.quantize_model(model, bits=4, min_features=1, progress=False)
    sd = model.state_dict()
    sd["0.packed"] = sd["0.packed"].to(dtype)
    with pytest.raises(RuntimeError, match="packed must be int32"):
        model.load_state_dict(sd)


def test_mixed_devices_rejected():
    state, _ = _valid_state()
    qw = kbit.QuantizedWeight.from_state_dict(state)
    with pytest.raises(ValueError, match="one device"):
        kbit.QuantizedWeight(qw.packed, qw.absmax, qw.codebook, qw.scale.to("meta"), qw.bits, qw.shape, qw.dtype)


def test_missing_scale_after_assign_load_is_an_error_not_garbage():
    """strict=False, assign=True on a module built on meta, without its scale: a clear error, every call."""
    state, W = _valid_state(bits=4)
    layer = kbit.KbitLinear(70, 24, bias=False, bits=4, device="meta")
    del state["scale"]
    result = layer.load_state_dict(state, strict=False, assign=True)
    assert result.missing_keys == ["scale"]
    for _ in range(2):
        with pytest.raises(ValueError, match="scale on meta"):
            layer(torch.randn(2, 70, dtype=torch.float16))


def test_shapes_must_be_positive_ints():
    qw = kbit.quantize(torch.randn(24, 64))
    for shape in [(-24, 64), (24, 0), (24.0, 64), (24,), "24x64"]:
        with pytest.raises(CLEAR):
            kbit.QuantizedWeight(qw.packed, qw.absmax, qw.codebook, qw.scale, 4, shape, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        kbit.QuantizedWeight(qw.packed, qw.absmax, qw.codebook, qw.scale, 4, (24, 64), torch.int32)


# ----------------------------------------------------------------------------- precision loss is reported
def test_outlier_blocks_are_reported_with_counts():
    W = torch.randn(512, 512) * 0.02
    W[3, 7] = 1e4
    with pytest.warns(kbit.PrecisionWarning, match=r"W: (\d+) of 8192 blocks") as record:
        qw = kbit.quantize(W, bits=4)
    loss = kbit.weight.quantize_with_report(W, bits=4)[1]
    assert loss.beyond_bound > 0 and loss.zeroed > 0 and str(loss.beyond_bound) in str(record[0].message)
    assert bool(torch.isfinite(qw.dequantize()).all())
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    with torch.no_grad():
        model[2].weight.copy_(W)
    with pytest.warns(kbit.PrecisionWarning, match=r"^2\.weight: "):
        kbit.quantize_model(model, bits=4, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kbit.PrecisionWarning)
        with pytest.raises(kbit.PrecisionWarning):
            kbit.quantize(W, bits=4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_weights_at_the_dtype_maximum_stay_finite(dtype):
    big = torch.finfo(dtype).max
    W = torch.randn(8, 64).to(dtype)
    W[0, :3] = torch.tensor([big, -big, big * 0.999]).to(dtype)
    with pytest.warns(kbit.PrecisionWarning, match="saturated"):
        qw = kbit.quantize(W, bits=4)
    W_hat = qw.dequantize()
    assert bool(torch.isfinite(W_hat).all())
    # Saturated blocks clip by less than one E4M4 step; the other blocks are what the quantize op made.
    assert float((W_hat[0, :3].float() - W[0, :3].float()).abs().max()) <= big / 8
    packed, absmax = kbit.ops.quantize(W.contiguous(), qw.codebook, 4, qw.scale)
    assert int(qw.absmax[0]) == int(absmax[0]) - 1 and torch.equal(absmax[1:], qw.absmax[1:])
    assert torch.equal(packed[4:], qw.packed[4:])


# ----------------------------------------------------------------------------- clear errors
def test_quantize_model_nan_layer_is_named_and_model_unchanged():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with torch.no_grad():
        model[2].weight[5, 5] = float("nan")
    before = [type(m) for m in model]
    with pytest.raises(ValueError, match=r"cannot quantize 2: .*NaN.*the model is unchanged"):
        kbit.quantize_model(model, bits=4, min_features=1, progress=False)
    assert [type(m) for m in model] == before


def test_quantize_model_with_nothing_to_quantize_says_so():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    with pytest.warns(UserWarning, match=r"nothing to quantize .* 2 narrower than min_features=128"):
        kbit.quantize_model(model, bits=4, progress=False)
    with pytest.warns(UserWarning, match=r"2 skipped by name"):
        kbit.quantize_model(model, bits=4, skip=("0", "1"), min_features=1, progress=False)


def test_functional_api_messages():
    qw = kbit.quantize(torch.randn(64, 96), bits=4)
    b, a = qw.gemm_layout()
    x = torch.randn(2, 96).half()
    with pytest.raises(ValueError, match="in_features_padded must be a multiple of 32"):
        kbit.functional.kbit_gemm(x, b, a, qw.codebook, 4, 64, 50, scale=qw.scale)
    with pytest.raises(TypeError, match="in_features_padded must be an int"):
        kbit.functional.kbit_gemm(x, b, a, qw.codebook, 4, 64, 96.0, scale=qw.scale)
    with pytest.raises(TypeError, match="GEMM layout must be"):
        kbit.functional.kbit_gemm(x, b.to(torch.int64), a, qw.codebook, 4, 64, 96, scale=qw.scale)
    with pytest.raises(TypeError, match="out_features must be an int"):
        kbit.functional.repack_for_gemm(qw.packed, qw.absmax, 4, 40.0, 96)
    with pytest.raises(ValueError, match="out_features must be >= 1"):
        kbit.functional.repack_for_gemm(qw.packed, qw.absmax, 4, -64, 96)
    with pytest.raises(TypeError, match="n must be an int"):
        kbit.functional.dequantize_kbit(qw.packed, qw.absmax, qw.codebook, 4, 64.5)
    with pytest.raises(TypeError, match="encode_absmax_e4m4 expects a floating-point torch.Tensor"):
        kbit.functional.encode_absmax_e4m4([0.5, 1.0])
    with pytest.raises(TypeError, match="decode_absmax_e4m4 expects a uint8 torch.Tensor"):
        kbit.functional.decode_absmax_e4m4([3, 4])
    with pytest.raises(TypeError, match="grid_override must be an int"):
        kbit.matmul(x, qw, grid_override=1.5)


# ----------------------------------------------------------------------------- block scales within the dtype
def _large_fp16_state():
    """A valid fp16 weight near its dtype's largest value: its scale leaves no room for a larger block scale."""
    W = (torch.rand(8, 64) * 2 - 1) * 6e4
    state = kbit.quantize(W.to(torch.float16), bits=4).state_dict()
    assert bool(torch.isfinite(kbit.QuantizedWeight.from_state_dict(state).dequantize()).all())
    state["absmax"][0] = 255  # E4M4's largest code: 31 * scale, past float16's largest value
    return state


def test_block_scales_past_the_dtype_range_are_refused():
    state = _large_fp16_state()
    with pytest.raises(ValueError, match="absmax with scale: .* past float16's largest value 65504"):
        kbit.QuantizedWeight.from_state_dict(state)
    layer = kbit.KbitLinear(64, 8, bias=False, bits=4)
    with pytest.raises(RuntimeError, match="past float16's largest value"):
        layer.load_state_dict(state)
    assert int(layer.absmax.max()) == 0  # nothing assigned


def test_experts_scales_past_the_dtype_range_are_refused():
    experts, _ = kbit.KbitExperts.from_weights(torch.randn(3, 64, 32).half(), torch.randn(3, 32, 32).half())
    state = experts.state_dict()
    state["down_scale"][2] = 2.0**20
    fresh = kbit.KbitExperts(3, 32, 32, bits=4)
    with pytest.raises(RuntimeError, match="down_absmax with down_scale, expert 2: .* past float16"):
        fresh.load_state_dict(state)
    state["down_scale"][2] = 2.0**-1
    fresh.load_state_dict(state)  # a valid scale loads


def test_dequantize_into_a_narrower_dtype_warns_of_inf():
    """A finite fp32 weight past fp16's range: dequantize(qw, float16) says how many values became Inf."""
    qw = kbit.quantize(torch.randn(32, 64) * 1e5)
    with pytest.warns(kbit.PrecisionWarning, match=r"dequantize: \d+ of 2048 values of a float32 weight lie past "
                                                   "float16's largest value and became Inf"):
        w = kbit.dequantize(qw, torch.float16)
    assert bool(torch.isinf(w).any())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kbit.dequantize(qw)  # its own dtype: finite, no warning
        kbit.dequantize(kbit.quantize(torch.randn(32, 64)), torch.float16)  # narrower but in range
    rotated = kbit.quantize_model(nn.Sequential(nn.Linear(64, 32)), bits=4, rotate=True, min_features=0,
                                  progress=False)[0]
    with torch.no_grad():
        rotated.scale.mul_(2.0**20)  # weights near 0.1 * 2**20: past fp16 once un-rotated
    with pytest.warns(kbit.PrecisionWarning, match="became Inf"):
        rotated.weight.dequantize(torch.float16)


# ----------------------------------------------------------------------------- the ops' contract on every backend
def _op_storage():
    qw = kbit.quantize(torch.randn(4, 64), bits=4)
    return qw.packed, qw.absmax, qw.codebook, qw.scale


@pytest.mark.parametrize("case, match", [
    ("n_beyond_data", r"packed must have shape \(36,\)"),
    ("bits_1", "bits must be one of"),
    ("bits_6", "bits must be one of"),
    ("bits_8", "bits must be one of"),
    ("codebook_32_at_bits_4", r"codebook must have shape \(16,\)"),
    ("absmax_broadcast", r"absmax must have shape \(8,\)"),
    ("packed_int64", "packed must be int32, got int64"),
    ("absmax_int32", "absmax must be uint8, got int32"),
    ("codebook_float64", "codebook must be float32"),
    ("scale_float16", "scale must be float32"),
    ("scale_two_values", "scale must hold one float32"),
    ("dtype_int32", "dtype must have dtype in"),
    ("negative_n", "n must be >= 0"),
    ("strided_packed", "packed must be contiguous"),
])
def test_raw_dequantize_op_refuses_what_the_cuda_binding_refuses(case, match):
    packed, absmax, cb, scale = _op_storage()
    args = dict(packed=packed, absmax=absmax, codebook=cb, bits=4, n=4 * 64, dtype=torch.float32, scale=scale)
    change = {
        "n_beyond_data": dict(n=4 * 64 + 32), "bits_1": dict(bits=1), "bits_6": dict(bits=6), "bits_8": dict(bits=8),
        "codebook_32_at_bits_4": dict(codebook=torch.linspace(-1, 1, 32)), "absmax_broadcast": dict(absmax=absmax[:1]),
        "packed_int64": dict(packed=packed.long()), "absmax_int32": dict(absmax=absmax.int()),
        "codebook_float64": dict(codebook=cb.double()), "scale_float16": dict(scale=scale.half()),
        "scale_two_values": dict(scale=torch.ones(2)), "dtype_int32": dict(dtype=torch.int32),
        "negative_n": dict(n=-1), "strided_packed": dict(packed=torch.stack([packed, packed], 1)[:, 0]),
    }[case]
    args.update(change)
    with pytest.raises(CLEAR, match=match):
        torch.ops.kbit.dequantize(*args.values())


def test_raw_layout_quantize_and_gemm_ops_refuse_bad_arguments():
    packed, absmax, cb, scale = _op_storage()
    N, K = 4, 64
    with pytest.raises(CLEAR, match=r"absmax must have shape \(8,\)"):
        torch.ops.kbit.repack(packed, absmax[:1], 4, N, K)
    with pytest.raises(CLEAR, match="in_features_padded must be a multiple of 32"):
        torch.ops.kbit.repack(packed, absmax, 4, N * 2, K // 2 + 16)
    b, a = torch.ops.kbit.repack(packed, absmax, 4, N, K)
    with pytest.raises(CLEAR, match="b_gemm must have shape"):
        torch.ops.kbit.unrepack(b, a, 4, 512, K)
    with pytest.raises(CLEAR, match="bits must be one of"):
        torch.ops.kbit.quantize(torch.randn(64), cb, 6, scale)
    with pytest.raises(CLEAR, match="A must have dtype in"):
        torch.ops.kbit.quantize(torch.arange(64), cb, 4, scale)
    x = torch.randn(3, K, dtype=torch.float16)
    with pytest.raises(CLEAR, match="x has 96 columns"):
        torch.ops.kbit.gemm(torch.randn(3, 96, dtype=torch.float16), b, a, cb, scale, None, 4, N, K, 0)
    with pytest.raises(CLEAR, match=r"bias must have shape \(4,\)"):
        torch.ops.kbit.gemm(x, b, a, cb, scale, torch.zeros(1, dtype=torch.float16), 4, N, K, 0)
    with pytest.raises(CLEAR, match="x must have dtype in"):
        torch.ops.kbit.gemm(x.int(), b, a, cb, scale, None, 4, N, K, 0)
    assert torch.ops.kbit.gemm(x, b, a, cb, scale, None, 4, N, K, 0).shape == (3, N)


@functools.lru_cache(maxsize=None)
def _moe_op_args() -> dict:
    """Valid arguments of each MoE op: 3 experts' [32, 64] weights at k = 4 (GEMM layouts stacked), 5 tokens routed
    to 2 of them."""
    weights = [kbit.quantize(torch.randn(32, 64), bits=4) for _ in range(3)]
    layouts = [torch.ops.kbit.repack(w.packed, w.absmax, 4, 32, 64) for w in weights]
    ids, routing_weights = torch.randint(0, 3, (5, 2)), torch.rand(5, 2)
    x_rows, row_weights, position, passes, num_passes = torch.ops.kbit.moe_route(ids, routing_weights, 3, 8)
    return {
        "moe_route": dict(expert_ids=ids, weights=routing_weights, num_experts=3, rows_per_pass=8),
        "moe_gemm": dict(x=torch.randn(5, 64, dtype=torch.float16), b_gemm=torch.stack([b for b, _ in layouts]),
                         absmax_gemm=torch.stack([a for _, a in layouts]), codebook=weights[0].codebook,
                         scale=torch.stack([w.scale for w in weights]), x_rows=x_rows, row_weights=row_weights,
                         passes=passes, num_passes=num_passes, bits=4, out_features=32, in_features_padded=64,
                         rows_per_pass=8, silu_gate=False, grid_override=0),
        "moe_combine": dict(y=torch.randn(10, 32, dtype=torch.float16), position=position),
    }


@pytest.mark.parametrize("op, change, match", [
    ("moe_route", dict(expert_ids=torch.zeros(5, 2)), "expert_ids must be int64 or int32, got float32"),
    ("moe_route", dict(expert_ids=torch.zeros(10, dtype=torch.int64)), "expert_ids must be 2-D"),
    ("moe_route", dict(weights=torch.rand(5, 1)), r"weights must have shape \(5, 2\)"),
    ("moe_route", dict(weights=torch.ones(5, 2, dtype=torch.int32)), "weights must have dtype in"),
    ("moe_route", dict(num_experts=0), "num_experts must be >= 1"),
    ("moe_route", dict(rows_per_pass=0), "rows_per_pass must be >= 1"),
    ("moe_gemm", dict(bits=6), "bits must be one of"),
    ("moe_gemm", dict(x=torch.randn(5, 64)), "x must have dtype in"),
    ("moe_gemm", dict(x=torch.randn(5, 60, dtype=torch.float16)), "x must have a multiple of 8 columns"),
    ("moe_gemm", dict(x=torch.randn(5, 96, dtype=torch.float16)), "at most in_features_padded = 64"),
    ("moe_gemm", dict(x=torch.randn(64, 5, dtype=torch.float16).T), "x must be contiguous"),
    ("moe_gemm", dict(in_features_padded=48), "in_features_padded must be a multiple of 32"),
    ("moe_gemm", dict(out_features=300), "b_gemm must have shape"),
    ("moe_gemm", dict(codebook=torch.linspace(-1, 1, 8)), r"codebook must have shape \(16,\)"),
    ("moe_gemm", dict(scale=torch.ones(())), r"scale must have shape \(3,\)"),
    ("moe_gemm", dict(x_rows=torch.zeros(10, dtype=torch.int64)), "x_rows must be int32"),
    ("moe_gemm", dict(row_weights=torch.ones(9)), r"row_weights must have shape \(10,\)"),
    ("moe_gemm", dict(silu_gate=True), "row_weights apply to the plain epilogue, not silu_gate"),
    ("moe_gemm", dict(passes=torch.zeros(8, 3, dtype=torch.int32)), r"passes must have shape \(8, 4\)"),
    ("moe_gemm", dict(num_passes=torch.zeros(2, dtype=torch.int32)), r"num_passes must have shape \(1,\)"),
    ("moe_gemm", dict(grid_override=-1), "grid_override must be >= 0"),
    ("moe_combine", dict(y=torch.randn(10, 32)), "y must have dtype in"),
    ("moe_combine", dict(y=torch.randn(10, 20, dtype=torch.float16)), "y must have a multiple of 8 columns"),
    ("moe_combine", dict(position=torch.zeros(5, 2, dtype=torch.int64)), "position must be int32"),
    ("moe_combine", dict(position=torch.zeros(10, dtype=torch.int32)), r"position must be \[tokens, top_k\]"),
])
def test_raw_moe_ops_refuse_what_the_cuda_binding_refuses(op, change, match):
    args = dict(_moe_op_args()[op], **change)
    with pytest.raises(CLEAR, match=match):
        getattr(torch.ops.kbit, op)(*args.values())


def test_raw_moe_ops_take_what_the_cuda_binding_takes():
    """The arguments the refusals above change one at a time are valid."""
    for op, args in _moe_op_args().items():
        getattr(torch.ops.kbit, op)(*args.values())


# ----------------------------------------------------------------------------- messages that say what is wrong
def test_skip_must_be_names():
    model = nn.Sequential(nn.Linear(64, 64))
    for call in (lambda s: kbit.KbitConfig(skip=s), lambda s: kbit.quantize_model(model, skip=s, progress=False)):
        not_names = r"skip must be a module name or pattern \(str\) or a list of them, got int \(5\)"
        with pytest.raises(TypeError, match=not_names):
            call(5)
        with pytest.raises(TypeError, match=r"skip must hold module names or patterns \(str\), got 5 \(int\)"):
            call(["lm_head", 5])
    assert kbit.KbitConfig(skip=("a", "b")).skip == ["a", "b"] and kbit.KbitConfig(skip="a").skip == ["a"]


def test_config_codebook_must_be_numbers():
    with pytest.raises(TypeError, match="codebook must be a tensor or a list of 16 numbers, got"):
        kbit.KbitConfig(bits=4, codebook=["a"] * 16)
    with pytest.raises(TypeError, match="codebook must be a tensor or a list of 4 numbers"):
        kbit.KbitConfig(bits=2, codebook="abcd")
    assert kbit.KbitConfig(bits=2, codebook=[-1, -0.25, 0.5, 1]).codebook == [-1.0, -0.25, 0.5, 1.0]


def test_assigning_a_quantized_weight_says_how_to_replace_it():
    layer = kbit.KbitLinear(64, 8, bits=4)
    for value in (nn.Parameter(torch.zeros(8, 64)), torch.zeros(8, 64)):
        with pytest.raises(AttributeError, match="KbitLinear.weight cannot be assigned: the layer holds it quantized"):
            layer.weight = value
    layer.bias = nn.Parameter(torch.ones(8, dtype=torch.float16))  # other attributes as usual
    experts = kbit.KbitExperts(2, 32, 32, bits=4)
    with pytest.raises(AttributeError, match="KbitExperts.gate_up_proj cannot be assigned"):
        experts.gate_up_proj = nn.Parameter(torch.zeros(2, 64, 32))  # would be a parameter nothing reads
    assert "gate_up_proj" not in dict(experts.named_parameters())
