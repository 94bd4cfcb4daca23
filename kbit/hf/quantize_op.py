"""Quantizing a layer while transformers loads it (``from_pretrained(..., quantization_config=KbitConfig(...))``).

transformers reads the checkpoint one tensor at a time and hands each weight that ``KbitHfQuantizer`` marked
(``param_needs_quantization``) to this operation instead of the model. The operation quantizes it and puts a kbit
module in the layer's place right away, so the full-precision weight is garbage as soon as it returns: at no point
does the process hold more than one layer's weight in full precision.

A fused experts module's two weights (``gate_up_proj``, ``down_proj``; transformers assembles each from the
checkpoint's per-expert tensors) arrive one at a time: the first is quantized into an all-zero ``KbitExperts`` held
aside, the second into its other projection, and then the ``KbitExperts`` (its GEMM layout derived) replaces the
module: a model never holds half-quantized experts.
"""

from __future__ import annotations

import torch
from transformers.core_model_loading import ConversionOps

from .._layers import is_conv1d
from .._validate import check_dtype, check_weight
from ..moe import FUSED_PARAMETERS, KbitExperts, canonical_weight, experts_shape
from ..nn import KbitLinear
from ..rotation import Rotation
from ..weight import quantize_checked, warn_precision


class QuantizeWhileLoading(ConversionOps):
    """``{"<layer>.weight": tensor}`` or ``{"<experts>.gate_up_proj" / "<experts>.down_proj": tensor}``: quantize it
    into the kbit module that replaces the layer; nothing is left for transformers to set."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    @torch.no_grad()
    def convert(self, input_dict, model=None, missing_keys=None, **kwargs):
        for key, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            name, _, tensor_name = key.rpartition(".")
            if name in self.hf_quantizer.experts:
                self._quantize_experts(model, name, tensor_name, value)
            else:
                self._quantize_linear(model, name, key, value)
            if missing_keys is not None:
                missing_keys.discard(key)
            self.hf_quantizer.progress.update()
        return {}

    def _quantize_linear(self, model, name: str, key: str, value: torch.Tensor) -> None:
        config = self.hf_quantizer.quantization_config
        layer = model.get_submodule(name)
        weight = check_weight(value.t() if is_conv1d(layer) else value, key)  # Conv1D stores [in, out]
        rotation = Rotation.for_layer(name, weight.shape[1]) if config.rotate else None
        if rotation is not None:
            weight = rotation.rotate(weight.float()).to(weight.dtype)
        # KbitConfig checked bits and codebook; the checkpoint's weight is checked above
        qw, loss = quantize_checked(weight, config.bits, config.codebook_tensor())
        warn_precision(loss, key, stacklevel=3)
        new = KbitLinear._wrap(qw, None, rotation)  # kbit made both
        if layer.bias is not None:
            new.bias = layer.bias  # the same parameter, whether transformers has loaded it yet or not
        _take_over_tp(layer, new)
        model.set_submodule(name, new)

    def _quantize_experts(self, model, name: str, tensor_name: str, value: torch.Tensor) -> None:
        config = self.hf_quantizer.quantization_config
        original = self.hf_quantizer.experts[name]
        if name not in self.hf_quantizer.experts_pending:  # bits and codebook: KbitConfig checked them
            dtype = check_dtype(value.dtype, f"{name}.{tensor_name}")
            self.hf_quantizer.experts_pending[name] = (
                KbitExperts.from_checked(*experts_shape(original), config.bits, dtype, value.device,
                                         config.codebook_tensor(), original.act_fn), set())
        experts, loaded = self.hf_quantizer.experts_pending[name]
        losses = experts.quantize_projection(tensor_name.removesuffix("_proj"), canonical_weight(original, value), name)
        for label, loss in losses:
            warn_precision(loss, label, stacklevel=3)
        loaded.add(tensor_name)
        if loaded == set(FUSED_PARAMETERS):
            _take_over_tp(original, experts)
            model.set_submodule(name, experts.prepare())
            del self.hf_quantizer.experts_pending[name]


def _take_over_tp(layer, quantized) -> None:
    """Under a tp_plan, the split that ``kbit.hf.tensor_parallel`` planned for ``layer`` passes to the kbit module
    replacing it (``finish_loading`` cuts this rank's shard once every tensor is loaded)."""
    for key in ("_kbit_tp_whole", "_kbit_head_dim"):
        if key in layer.__dict__:
            quantized.__dict__[key] = layer.__dict__[key]
