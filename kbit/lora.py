"""PEFT LoRA on kbit layers (QLoRA-style): the k-bit base weights stay frozen, low-rank adapters train.

    from peft import LoraConfig, get_peft_model
    import kbit.lora
    model = get_peft_model(model, kbit.lora.register(LoraConfig(r=16, target_modules=["q_proj", "v_proj"])))

PEFT chooses a LoRA layer by the type of the layer it wraps and knows only its own and a few quantized types;
``register`` adds kbit's (``KbitLoraLinear``, for ``KbitLinear``) to the config through PEFT's custom-module
mapping. That mapping is not saved with the adapter, so load a trained one with
``PeftModel.from_pretrained(model, path, config=kbit.lora.register(LoraConfig.from_pretrained(path)))``.

Forward and backward go through ``kbit.matmul``, differentiable in its input, plus the adapters'
``lora_B(lora_A(dropout(x))) * scaling``. Merging an adapter into the k-bit weight would re-quantize it (lossy)
and is refused: merge into the full-precision model instead.
"""

from __future__ import annotations

from peft import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear

from .nn import KbitLinear

__all__ = ["KbitLoraLinear", "register"]


class KbitLoraLinear(LoraLinear):
    """PEFT's LoRA ``Linear`` around a ``KbitLinear`` (built by PEFT once ``register`` added it to the config)."""

    def __init__(self, base_layer, adapter_name: str, config: LoraConfig, **kwargs):
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        # A KbitLinear stores [out, in] even where it replaced a GPT-2 Conv1D, whose LoRA configs say fan_in_fan_out.
        self.fan_in_fan_out = False

    def _get_in_out_features(self, module):
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        return base.in_features, base.out_features

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError(
            "merging a LoRA adapter into a kbit layer would re-quantize the weight (lossy); load the model in full "
            "precision, apply the adapter there (PeftModel.from_pretrained) and merge_and_unload() that"
        )


def register(config: LoraConfig) -> LoraConfig:
    """Return ``config`` with ``KbitLoraLinear`` registered for ``KbitLinear`` layers."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a peft.LoraConfig, got {type(config).__name__}")
    config._register_custom_module({KbitLinear: KbitLoraLinear})
    return config
