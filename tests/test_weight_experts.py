"""QuantizedWeight with a leading expert dimension ([E, out_features, in_features]): each expert's row is what
kbit.quantize makes of that expert alone; the GEMM layout is each expert's stacked (rows optionally reordered); both
forms give back the same storage, dequantize and per-expert weights; bad shapes are refused by name."""

from __future__ import annotations

import pytest
import torch

import kbit
from kbit import ops
from kbit.grouped import gate_up_row_order, interleave_gate_up
from kbit.weight import QuantizedWeight

E, N, K = 3, 80, 72  # K padded to 96 columns; N = 2 * 40 gate/up rows, interleaved by 8 with the row order


def _experts(bits=3, dtype=torch.float32, row_order=True, seed=0):
    """(the 3-D weight, each expert's kbit.quantize)"""
    torch.manual_seed(seed)
    W = (torch.randn(E, N, K) * 0.05).to(dtype)
    W[1] *= 1000.0  # its own per-tensor scale
    each = [kbit.quantize(W[e], bits) for e in range(E)]
    packed, absmax, scale = (torch.stack([getattr(q, key) for q in each]) for key in ("packed", "absmax", "scale"))
    order = gate_up_row_order(N // 2) if row_order else None
    return QuantizedWeight(packed, absmax, each[0].codebook, scale, bits, (E, N, K), dtype, row_order=order), each


def _same_storage(a: QuantizedWeight, b: QuantizedWeight) -> None:
    for key in ("packed", "absmax", "scale", "codebook"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert (a.shape, a.dtype, a.bits) == (b.shape, b.dtype, b.bits)


@pytest.mark.parametrize("bits", (2, 5))
def test_each_expert_is_its_own_quantize_in_both_forms(bits):
    qw, each = _experts(bits, torch.bfloat16)
    assert qw.experts == E and (qw.out_features, qw.in_features, qw.in_features_padded) == (N, K, 96)
    resident = qw.gemm_resident()
    assert resident.is_gemm_resident and resident.row_order is qw.row_order
    for w in (qw, resident):
        experts = list(w)
        assert len(experts) == E
        for e in range(E):
            _same_storage(w[e], each[e])
            _same_storage(experts[e], each[e])
        packed, absmax = w.storage()  # derived bit for bit from the resident one's layout
        assert torch.equal(packed, qw.packed) and torch.equal(absmax, qw.absmax)
        want = torch.stack([q.dequantize() for q in each])
        got = w.dequantize()
        assert got.shape == (E, N, K) and got.dtype == torch.bfloat16 and torch.equal(got, want)
        assert torch.equal(w.dequantize(torch.float32), torch.stack([q.dequantize(torch.float32) for q in each]))


def test_layout_is_each_experts_stacked_with_rows_in_order():
    qw, each = _experts()
    b, a = qw.gemm_layout()
    plain, _ = _experts(row_order=False)
    b_plain, a_plain = plain.gemm_layout()
    for e, q in enumerate(each):
        rows = N // 2
        packed = interleave_gate_up(q.packed.view(N, -1), rows).reshape(-1)  # what the grouped GEMM reads
        absmax = interleave_gate_up(q.absmax.view(N, -1), rows).reshape(-1)
        want_b, want_a = ops.repack(packed, absmax, q.bits, N, q.in_features_padded)
        assert torch.equal(b[e], want_b) and torch.equal(a[e], want_a)
        assert all(torch.equal(x, y) for x, y in zip((b_plain[e], a_plain[e]), q.gemm_layout()))
    assert not torch.equal(b, b_plain)  # the order matters


def test_moves_and_sizes():
    qw, each = _experts()
    resident = qw.gemm_resident()
    assert qw.nbytes == resident.nbytes == sum(q.nbytes for q in each) - (E - 1) * 4 * qw.codebook.numel()
    assert qw.bits_per_weight == pytest.approx(8 * qw.nbytes / (E * N * K))
    assert resident.resident_bytes == sum(t.numel() * t.element_size() for t in resident.resident)
    assert qw.resident_bytes == sum(q.resident_bytes for q in each) - (E - 1) * 4 * qw.codebook.numel() + sum(
        t.numel() * t.element_size() for t in qw.gemm_layout())  # the layout cached beside the storage now
    moved = resident.to("cpu")  # the storage format, derived
    assert not moved.is_gemm_resident and moved.row_order is qw.row_order
    _same_storage(moved, qw)
    assert torch.equal(moved.gemm_layout()[0], resident.gemm_layout()[0])


def test_matmul_state_dict_and_indexing_are_refused_by_name():
    qw, each = _experts()
    with pytest.raises(TypeError, match=r"QuantizedWeight of 3 experts, shape \[3, 80, 72\]: kbit.matmul"):
        kbit.matmul(torch.randn(2, K), qw)
    with pytest.raises(TypeError, match="3 experts has no single-weight meta or state_dict"):
        qw.state_dict()
    with pytest.raises(TypeError, match=r"a \[80, 72\] QuantizedWeight has no experts"):
        each[0][0]
    with pytest.raises(TypeError, match="has no experts"):
        list(each[0])
    with pytest.raises(ValueError, match="expert must be < 3, got 3"):
        qw[3]
    with pytest.raises(ValueError, match="expert must be >= 0"):
        qw[-1]


def test_bad_shapes_are_refused_by_name():
    qw, each = _experts()
    args = (qw.packed, qw.absmax, qw.codebook, qw.scale, 3)
    with pytest.raises(ValueError, match=r"shape must be \(out_features, in_features\) or \(experts, out_features"):
        QuantizedWeight(*args, (1, E, N, K), torch.float32)
    with pytest.raises(ValueError, match=r"shape\[0\] must be >= 1"):
        QuantizedWeight(*args, (0, N, K), torch.float32)
    with pytest.raises(ValueError, match=r"packed of a bits=3 \[4, 80, 72\] weight \(blocks of 32\) must have shape "
                                         r"\(4, 720\), got \(3, 720\)"):
        QuantizedWeight(*args, (4, N, K), torch.float32)
    with pytest.raises(ValueError, match=r"scale of a bits=3 \[3, 80, 72\] weight .* must have shape \(3,\), got \(\)"):
        QuantizedWeight(qw.packed, qw.absmax, qw.codebook, qw.scale[0], 3, (E, N, K), torch.float32)
    with pytest.raises(ValueError, match=r"row_order is for a weight of experts .* a \[80, 72\] weight"):
        QuantizedWeight(*(getattr(each[0], k) for k in ("packed", "absmax", "codebook", "scale")), 3, (N, K),
                        torch.float32, row_order=torch.arange(N))
    with pytest.raises(ValueError, match=r"row_order must be int64 of shape \(80,\), .* got torch.int64 \(40,\)"):
        QuantizedWeight(*args, (E, N, K), torch.float32, row_order=torch.arange(N // 2))
    b, a = qw.gemm_layout()
    with pytest.raises(ValueError, match="a GEMM layout of int32 .* was expected"):
        QuantizedWeight.from_gemm_layout(b[0], a[0], qw.codebook, qw.scale, 3, (E, N, K), torch.float32)
