"""PEFT LoRA on kbit layers (QLoRA-style): PEFT's own calls, with no kbit-specific step.

    from peft import LoraConfig, PeftModel, get_peft_model
    model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    model = PeftModel.from_pretrained(model, "adapter/")

PEFT picks a LoRA layer by the type of the layer it wraps. ``KbitLinear`` subclasses ``nn.Linear`` (as
bitsandbytes' quantized layers do), so PEFT's default dispatch wraps it in its plain ``lora.Linear``: the forward
is ``KbitLinear``'s (``kbit.matmul``, differentiable in its input, the k-bit weight frozen) plus the adapters'
``lora_B(lora_A(dropout(x))) * scaling``. That holds for every PEFT version that has the default dispatch, and
for adapters saved and loaded (nothing kbit-specific is saved with them).

Merging an adapter into a k-bit weight would re-quantize it (lossy): PEFT's merge writes ``layer.weight``, which
is read-only (``kbit.DequantizedWeight``) and raises a ``TypeError`` saying so, before anything changed.

``register`` (what adding kbit's LoRA layer to a config used to need) is kept for old code and does nothing more.
"""

from __future__ import annotations

import warnings

from peft import LoraConfig

__all__ = ["register"]


def register(config: LoraConfig) -> LoraConfig:
    """Deprecated, no longer needed: returns ``config`` unchanged (PEFT wraps ``KbitLinear`` as an ``nn.Linear``)."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a peft.LoraConfig, got {type(config).__name__}")
    warnings.warn("kbit.lora.register is no longer needed: pass the LoraConfig to get_peft_model as it is",
                  DeprecationWarning, stacklevel=2)
    return config
