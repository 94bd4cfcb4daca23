"""One resident copy of the codes (CPU, reference ops): a GEMM-resident weight or layer derives its storage format
back from the GEMM layout bit for bit. On CPU a layer holds the storage format alone; the CUDA side of the same
contract (layers that move there hold only the layout) is tests/test_resident_cuda.py.

The layer tests here build the GEMM-resident form on CPU by hand (the reference ops read it on any device), so that
CI checks the inverse of every layout, including the MoE gate/up row interleave.
"""

from __future__ import annotations

import pytest
import torch

import kbit
import kbit.weight
from kbit import layout, ops
from kbit.dequantized_weight import DequantizedWeight
from kbit.formats import STATE_KEYS, padded_in_features
from kbit.moe import GEMM_LAYOUTS, STORAGE, KbitExperts
from kbit.nn import GEMM_LAYOUT

pytestmark = pytest.mark.usefixtures("one_thread")

# Every K, each with a shape: odd and padded in_features, rows that are not a multiple of 16 or 256, one row.
# (tests/test_ops.py round-trips the layout itself over more shapes.)
CASES = ((2, (1, 33)), (3, (17, 100)), (4, (300, 64)), (5, (40, 257)))


def gemm_layout_bytes(bits: int, out_features: int, in_features: int) -> int:
    """Bytes of the GEMM layout (docs/DESIGN.md#one-resident-copy): codes and block scales of the weight padded to
    256 rows and 256 columns."""
    n_pad = -(-out_features // 256) * 256
    k_256 = -(-padded_in_features(in_features) // 256) * 256
    return n_pad * k_256 * bits // 8 + n_pad * k_256 // 32


def _assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key].cpu(), want[key].cpu()), key


@pytest.mark.parametrize("k,shape", CASES, ids=lambda c: str(c))
def test_gemm_resident_weight_gives_back_its_storage_bit_for_bit(k, shape):
    qw = kbit.quantize(torch.randn(*shape), bits=k)
    g = qw.gemm_resident()
    assert g.is_gemm_resident and not qw.is_gemm_resident
    assert g.resident[:2] == qw.gemm_layout() and g.resident[2:] == (qw.codebook, qw.scale)
    packed, absmax = g.storage()
    assert torch.equal(packed, qw.packed) and torch.equal(absmax, qw.absmax)
    assert torch.equal(g.packed, qw.packed) and torch.equal(g.absmax, qw.absmax)
    _assert_same_state(g.state_dict("w."), qw.state_dict("w."))
    moved = g.to("cpu")  # off the GPU a weight holds the storage format
    assert not moved.is_gemm_resident and torch.equal(moved.packed, qw.packed)
    assert torch.equal(g.dequantize(), qw.dequantize())
    assert g.nbytes == qw.nbytes
    codebook_and_scale = 4 * 2**k + 4
    assert g.resident_bytes == gemm_layout_bytes(k, *shape) + codebook_and_scale
    assert qw.resident_bytes == qw.nbytes + gemm_layout_bytes(k, *shape)  # storage plus the cached layout
    x = torch.randn(3, shape[1])
    assert torch.equal(kbit.matmul(x, g), kbit.matmul(x, qw))


def test_gemm_resident_weight_checks_its_layout():
    qw = kbit.quantize(torch.randn(40, 64), bits=3)
    b, a = qw.gemm_layout()
    with pytest.raises(ValueError, match="GEMM layout of int32"):
        kbit.QuantizedWeight.from_gemm_layout(b[:, :0], a, qw.codebook, qw.scale, 3, (40, 64), torch.float32)
    with pytest.raises(ValueError, match="GEMM layout of int32"):
        kbit.QuantizedWeight.from_gemm_layout(b, a.to(torch.int32), qw.codebook, qw.scale, 3, (40, 64), torch.float32)
    with pytest.raises(ValueError, match="one device"):
        kbit.QuantizedWeight.from_gemm_layout(b, a, qw.codebook.to("meta"), qw.scale, 3, (40, 64), torch.float32)


def test_dequantized_weight_of_a_gemm_resident_weight_derives_nothing(monkeypatch):
    qw = kbit.quantize(torch.randn(48, 96), bits=4)
    g = qw.gemm_resident()
    calls = []
    real = ops.unrepack
    monkeypatch.setattr(ops, "unrepack", lambda *a: calls.append(1) or real(*a))
    view = DequantizedWeight(g)
    names, context = view.__tensor_flatten__()
    assert names == ["gemm_codes", "gemm_absmax", "codebook", "scale"] and not calls
    assert view.shape == (48, 96) and view.dtype == torch.float32 and not calls
    again = DequantizedWeight.__tensor_unflatten__({n: getattr(view, n) for n in names}, context, None, None)
    assert again.qweight.is_gemm_resident
    assert torch.equal(again.dequantize(), qw.dequantize()) and calls


def _layer(bits: int, out_features: int, in_features: int, rotate: bool = False) -> kbit.KbitLinear:
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    model = torch.nn.Sequential(linear)
    kbit.quantize_model(model, bits=bits, min_features=1, progress=False, rotate=rotate, skip=())
    return model[0]


def _as_gemm_resident_on_cpu(layer: kbit.KbitLinear) -> None:
    """What prepare() does on CUDA, on CPU by hand (the reference ops read the layout anywhere)."""
    layer._hold_layout()


def test_cpu_layer_holds_the_storage_format_only():
    layer = _layer(4, 40, 70)
    assert not layer.is_gemm_resident and layer.gemm_codes is None and layer.gemm_absmax is None
    assert list(layer.state_dict()) == ["bias", *STATE_KEYS]
    # A GEMM-resident weight wrapped on CPU: the layer holds its storage format, derived.
    qw = layer.qweight
    wrapped = kbit.KbitLinear.from_quantized(qw.gemm_resident(), layer.bias)
    assert not wrapped.is_gemm_resident and wrapped.gemm_codes is None
    _assert_same_state(wrapped.state_dict(), layer.state_dict())


@pytest.mark.parametrize("k,rotate", [(2, False), (3, True), (4, False), (5, True)])
def test_gemm_resident_layer_saves_moves_and_loads_its_storage_format(k, rotate):
    layer = _layer(k, 33, 96, rotate=rotate)
    want = {key: t.clone() for key, t in layer.state_dict().items()}
    x = torch.randn(2, 96)
    y = layer(x)
    _as_gemm_resident_on_cpu(layer)
    assert layer.is_gemm_resident and layer.qweight.is_gemm_resident
    _assert_same_state(layer.state_dict(), want)  # never the layout
    assert torch.equal(layer(x), y)
    assert layer.weight.qweight.is_gemm_resident
    # load_state_dict: into the storage format (a partial load keeps the rest), then prepare()
    layer.load_state_dict({"scale": want["scale"]}, strict=False)
    _assert_same_state(layer.state_dict(), want)
    _as_gemm_resident_on_cpu(layer)
    layer.to("cpu")  # _apply towards a device other than CUDA: the storage format travels
    assert not layer.is_gemm_resident and all(getattr(layer, name) is None for name in GEMM_LAYOUT)
    _assert_same_state(layer.state_dict(), want)
    assert torch.equal(layer(x), y)


def test_gemm_resident_layer_load_state_dict_reports_missing_storage_keys():
    layer = _layer(3, 64, 64)
    state = layer.state_dict()
    _as_gemm_resident_on_cpu(layer)
    result = layer.load_state_dict({k: v for k, v in state.items() if k != "absmax"}, strict=False)
    assert result.missing_keys == ["absmax"] and not result.unexpected_keys


@pytest.mark.parametrize("k", (3,))
def test_gemm_resident_experts_give_back_their_storage_bit_for_bit(k):
    E, H, I = 3, 72, 40  # H and I padded to 96 and 64 columns; 2I = 80 gate/up rows, interleaved by 8 in the layout
    mod, _ = KbitExperts.from_weights(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05, bits=k)
    want = {key: t.clone() for key, t in mod.state_dict().items()}
    assert list(want) == list(STORAGE[:6]) + ["codebook", "meta"]
    mod.derive_gemm_layouts()
    _assert_same_state(mod.state_dict(), want)  # both forms held: the layouts are never saved
    mod._hold_layout()  # what prepare() does on CUDA, on CPU by hand
    assert mod.is_gemm_resident
    _assert_same_state(mod.state_dict(), want)
    for proj in ("gate_up", "down"):
        for e in range(E):
            assert torch.equal(mod.expert_weight(proj, e).packed, want[f"{proj}_packed"][e])
    mod.to("cpu")  # leaving for a device other than CUDA: the storage format alone
    assert not mod.is_gemm_resident and all(getattr(mod, name) is None for name in GEMM_LAYOUTS)
    _assert_same_state(mod.state_dict(), want)


def test_a_refused_load_leaves_gemm_resident_experts_resident():
    """KbitExperts checks a state dict against its storage format, derived from the layouts when it holds them (on
    CUDA): a refused state dict leaves it holding its layouts, as before the call, not the derived storage (on CUDA
    its forward would then quietly leave the grouped GEMM), the very tensors (CUDA graphs read them in place)."""
    mod, _ = KbitExperts.from_weights(torch.randn(2, 64, 32) * 0.05, torch.randn(2, 32, 32) * 0.05, bits=3)
    state = mod.state_dict()
    mod._hold_layout()  # what prepare() does on CUDA, on CPU by hand
    layouts = {name: getattr(mod, name) for name in GEMM_LAYOUTS}
    bad = dict(state, gate_up_scale=state["gate_up_scale"] * 3)
    with pytest.raises(RuntimeError, match="powers of two"):
        mod.load_state_dict(bad)
    assert mod.is_gemm_resident and all(getattr(mod, f"{p}_packed") is None for p in ("gate_up", "down"))
    assert all(getattr(mod, name) is t for name, t in layouts.items())
    _assert_same_state(mod.state_dict(), state)

def test_both_layers_hold_their_layout_alike():
    """KbitModule._hold_layout, what prepare() does on CUDA for either layer: the storage format's codes dropped, the
    layout in their place, every buffer the GEMM reads marked static for CUDA graphs; KbitLinear keeps the view that
    derived the layout (no second derivation, no new check at the next call), as KbitExperts keeps its projections'."""
    layer = _layer(3, 40, 64)
    want = layer.qweight.gemm_layout()
    layer._hold_layout()
    kept = layer._views["weight"]
    assert layer.packed is None and layer.absmax is None and kept.is_gemm_resident and layer.qweight is kept
    assert kept.resident[:2] == (layer.gemm_codes, layer.gemm_absmax)
    assert all(torch.equal(getattr(layer, name), t) for name, t in zip(GEMM_LAYOUT, want))
    mod, _ = KbitExperts.from_weights(torch.randn(2, 64, 32) * 0.05, torch.randn(2, 32, 32) * 0.05, bits=3)
    mod._hold_layout()
    assert all(getattr(mod, f"{proj}_{s}") is None for proj in ("gate_up", "down") for s in ("packed", "absmax"))
    for proj in ("gate_up", "down"):
        kept = mod._views[proj]
        assert kept.is_gemm_resident and mod.projection(proj) is kept and kept.experts == 2
        assert kept.resident[:2] == (getattr(mod, f"{proj}_gemm_codes"), getattr(mod, f"{proj}_gemm_absmax"))
    for module, names in ((layer, ("codebook", "scale", *GEMM_LAYOUT)), (mod, ("codebook", *GEMM_LAYOUTS))):
        for name in names:
            assert getattr(module, name)._dynamo_static_input_type == "unguarded", name


def test_layout_reference_inverse_on_padding_is_dropped():
    # The layout's padding rows and columns hold zeros; what the inverse returns has exactly the storage's size.
    k, N, in_features_padded = 3, 17, 288
    nb = N * in_features_padded // 32
    packed = torch.randint(-(2**31), 2**31, (nb * k,), dtype=torch.int64).to(torch.int32)
    absmax = torch.randint(0, 256, (nb,), dtype=torch.int32).to(torch.uint8)
    b, a = layout.repack_reference(packed, absmax, k, N, in_features_padded)
    assert b.numel() * 4 > packed.numel() * 4 and a.numel() > absmax.numel()
    p2, a2 = ops.unrepack(b, a, k, N, in_features_padded)
    assert p2.shape == packed.shape and torch.equal(p2, packed) and torch.equal(a2, absmax)


def test_quantize_audits_in_pieces_with_the_same_result(monkeypatch):
    # Quantizing while loading onto the GPU: the audit's float32 temporaries are bounded by AUDIT_BLOCKS, not by the
    # layer; pieces change nothing (a huge outlier gives zeroed blocks, a near-max weight a saturated one).
    W = torch.randn(24, 100, dtype=torch.float16)
    W[3, 7] = 65000.0
    W[20] *= 1e-6
    want_qw, want = kbit.weight.quantize_with_report(W, bits=3)
    monkeypatch.setattr(kbit.weight, "AUDIT_BLOCKS", 5)
    got_qw, got = kbit.weight.quantize_with_report(W, bits=3)
    assert got == want and want.zeroed and want.saturated
    assert torch.equal(got_qw.packed, want_qw.packed) and torch.equal(got_qw.absmax, want_qw.absmax)


def test_saved_state_dict_moves_derived_storage_to_the_cpu_layer_by_layer(monkeypatch):
    from kbit.hf import folder

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    kbit.quantize_model(model, bits=4, min_features=1, skip=(), progress=False)
    want = {key: t.clone() for key, t in model.state_dict().items()}
    _as_gemm_resident_on_cpu(model[1])
    moved = []
    real = folder._derived_to_cpu
    monkeypatch.setattr(folder, "_derived_to_cpu", lambda module, *rest: moved.append(rest[1]) or real(module, *rest))
    state = folder.saved_state_dict(model)
    assert moved == ["1."]  # only the GEMM-resident layer's derived entries, right after that layer is saved
    assert not model[1]._state_dict_hooks  # removed again
    for key, t in want.items():
        assert torch.equal(state[key.replace("packed", "weight")], t), key
