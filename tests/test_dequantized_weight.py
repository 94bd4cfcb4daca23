"""KbitLinear.weight: the original weight's dtype, device and shape for free, its values dequantized only by the
operations that read them, read-only, never in the state dict."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kbit
from kbit.weight import QuantizedWeight


@pytest.fixture
def layer():
    lin = nn.Linear(72, 48).to(torch.bfloat16)
    return kbit.KbitLinear.from_linear(lin, bits=3)


def test_metadata_is_the_original_weights(layer):
    w = layer.weight
    assert isinstance(w, torch.Tensor) and isinstance(w, kbit.DequantizedWeight)
    assert w.shape == (48, 72) and w.dtype == torch.bfloat16 and w.device == layer.packed.device
    assert w.dim() == 2 and w.numel() == 48 * 72 and not w.requires_grad and w.is_floating_point()
    assert "weight" not in layer.state_dict() and "weight" not in dict(layer.named_parameters())
    assert "weight" not in dict(layer.named_buffers())


def test_reading_metadata_does_not_dequantize(layer, monkeypatch):
    calls = []
    real = QuantizedWeight.dequantize
    monkeypatch.setattr(QuantizedWeight, "dequantize", lambda self, dtype=None: calls.append(1) or real(self, dtype))
    for _ in range(3):
        w = layer.weight
        _ = (w.dtype, w.device, w.shape, w.size(0), w.ndim, repr(w))
    assert calls == []
    F.linear(torch.randn(2, 72, dtype=torch.bfloat16), layer.weight)
    assert len(calls) == 1  # one operation, one dequantization


def test_operations_see_the_dequantized_values(layer):
    x = torch.randn(5, 72, dtype=torch.bfloat16)
    w_hat = layer.dequantize()
    y = F.linear(x, layer.weight, layer.bias)
    assert type(y) is torch.Tensor and torch.equal(y, F.linear(x, w_hat, layer.bias))
    assert torch.equal(layer.weight.float(), w_hat.float()) and type(layer.weight.float()) is torch.Tensor
    assert torch.equal(layer.weight.dequantize(torch.float32), layer.dequantize(torch.float32))
    assert torch.equal(layer.weight.t().contiguous(), w_hat.t().contiguous())
    with torch.no_grad():
        torch.testing.assert_close(layer(x).float(), y.float(), rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_the_weight_is_read_only(layer):
    before = layer.packed.clone()
    for write in (lambda w: w.mul_(2), lambda w: w.zero_(), lambda w: w.copy_(torch.zeros(48, 72)),
                  lambda w: nn.init.normal_(w), lambda w: w.data.zero_(), lambda w: w.data.add_(1),
                  lambda w: setattr(w, "data", torch.zeros(48, 72, dtype=torch.bfloat16))):
        with pytest.raises(TypeError, match="read-only"):
            write(layer.weight)
    assert torch.equal(layer.packed, before)
    with pytest.raises((AttributeError, KeyError)):  # a property, not a parameter slot
        layer.weight = nn.Parameter(torch.zeros(48, 72))


def test_tolist_and_numpy_give_the_dequantized_values(layer):
    w_hat = layer.dequantize().float()
    assert layer.weight.float().tolist() == w_hat.tolist()
    assert torch.tensor(layer.weight.tolist(), dtype=torch.bfloat16).equal(layer.dequantize())
    f32 = kbit.KbitLinear.from_linear(nn.Linear(40, 8), bits=4)
    assert (f32.weight.numpy() == f32.dequantize().numpy()).all()


def test_a_kbit_layer_is_an_nn_linear_that_quantize_model_leaves_alone(layer):
    assert isinstance(layer, nn.Linear) and "weight" not in dict(layer.named_parameters())
    with pytest.raises(TypeError, match="re-initialized"):
        layer.reset_parameters()
    with pytest.raises(TypeError, match="not already a KbitLinear"):
        kbit.KbitLinear.from_linear(layer)
    model = nn.Sequential(layer)
    with pytest.warns(UserWarning, match="nothing to quantize"):
        assert kbit.quantize_model(model, bits=4, min_features=1, progress=False)[0] is layer


def test_follows_the_layer(layer):
    assert layer.weight.qweight is layer.qweight
    layer.packed = layer.packed.clone()  # a new buffer: a new view
    assert layer.weight.qweight is layer.qweight and layer.weight.packed is layer.packed
    meta = kbit.KbitLinear(72, 48, bits=2, dtype=torch.float16, device="meta")
    assert meta.weight.device.type == "meta" and meta.weight.dtype == torch.float16
    clone = copy.deepcopy(layer.weight)
    assert type(clone) is kbit.DequantizedWeight and torch.equal(clone.dequantize(), layer.dequantize())


def test_compiles(layer):
    x = torch.randn(3, 72, dtype=torch.bfloat16)
    fn = torch.compile(lambda x, w: F.linear(x, w), backend="eager", fullgraph=True)
    assert torch.equal(fn(x, layer.weight), F.linear(x, layer.dequantize()))
