"""Quantizing a layer while transformers loads it (``from_pretrained(..., quantization_config=KbitConfig(...))``).

transformers reads the checkpoint one tensor at a time and hands each weight that ``KbitHfQuantizer`` marked
(``param_needs_quantization``) to this operation instead of the model. The operation quantizes it and puts a
``KbitLinear`` in the layer's place right away, so the full-precision weight is garbage as soon as it returns:
at no point does the process hold more than one layer's weight in full precision.
"""

from __future__ import annotations

import torch
from transformers.core_model_loading import ConversionOps

from ._layers import is_conv1d
from ._validate import check_weight
from .nn import KbitLinear
from .weight import quantize_checked, warn_precision


class QuantizeWhileLoading(ConversionOps):
    """``{"<layer>.weight": tensor}``: quantize it, replace the layer by a ``KbitLinear``; nothing left to set."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    @torch.no_grad()
    def convert(self, input_dict, model=None, missing_keys=None, **kwargs):
        config = self.hf_quantizer.quantization_config
        for key, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            name = key.rpartition(".")[0]
            layer = model.get_submodule(name)
            weight = value.t() if is_conv1d(layer) else value  # Conv1D stores [in, out]
            # KbitConfig checked bits and codebook; the checkpoint's weight is checked here
            qw, loss = quantize_checked(check_weight(weight, key), config.bits, config.codebook_tensor())
            warn_precision(loss, key)
            new = KbitLinear.from_quantized(qw)
            if layer.bias is not None:
                new.bias = layer.bias  # the same parameter, whether transformers has loaded it yet or not
            model.set_submodule(name, new)
            if missing_keys is not None:
                missing_keys.discard(key)
            self.hf_quantizer.progress.update()
        return {}
