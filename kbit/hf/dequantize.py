"""``model.dequantize()`` for a kbit model: transformers' way back to a full-precision model.

Each ``KbitLinear`` becomes the layer it replaced (``nn.Linear``, or GPT-2's ``Conv1D`` with its weight stored
[in, out]) and each ``KbitExperts`` the model's own fused experts module, holding the dequantized weights (the
quantization error stays: the result is what the kbit model computes, in full precision). Which class each layer
had is read from a skeleton of the model built on the meta device from its config, so a kbit folder loaded
without its original checkpoint dequantizes too; the result saves as a plain transformers model.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from .._layers import is_conv1d
from ..moe import FUSED_PARAMETERS, KbitExperts, canonical_weight
from ..nn import KbitLinear

__all__ = ["dequantize_model"]


def _skeleton(model: nn.Module) -> nn.Module:
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        return type(model)(config)


def _linear(layer: KbitLinear, like: nn.Module, dtype: torch.dtype) -> nn.Module:
    weight = layer.dequantize(dtype)
    bias = None if layer.bias is None else layer.bias.detach().to(dtype)
    if is_conv1d(like):  # Conv1D(nf=out_features, nx=in_features) stores [in, out]
        new = copy.deepcopy(like).to_empty(device=weight.device)
        new.weight = nn.Parameter(weight.t().contiguous())
        new.bias = None if bias is None else nn.Parameter(bias)
        return new
    new = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None, device="meta")
    new.weight = nn.Parameter(weight)
    if bias is not None:
        new.bias = nn.Parameter(bias)
    return new


def _experts(experts: KbitExperts, like: nn.Module, dtype: torch.dtype) -> nn.Module:
    new = copy.deepcopy(like).to_empty(device=experts.codebook.device)
    for name in FUSED_PARAMETERS:  # "gate_up_proj" -> the "gate_up" projection, in the module's own layout
        weight = canonical_weight(new, experts.dequantize(name.removesuffix("_proj"), dtype))
        setattr(new, name, nn.Parameter(weight.contiguous()))
    return new.to(dtype)


def dequantize_model(model: nn.Module, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Replace every kbit layer of the transformers ``model`` with its full-precision counterpart, in place
    (``dtype``: default each layer's original dtype). Returns the model."""
    skeleton = _skeleton(model)
    replaced = {}
    for name, m in list(model.named_modules(remove_duplicate=False)):
        if not isinstance(m, (KbitLinear, KbitExperts)):
            continue
        if id(m) not in replaced:  # a layer shared under several names stays shared
            layer_dtype = dtype or m.weight_dtype
            like = skeleton.get_submodule(name)
            rebuild = _linear if isinstance(m, KbitLinear) else _experts
            replaced[id(m)] = rebuild(m, like, layer_dtype)
        model.set_submodule(name, replaced[id(m)])
    return model
