"""The quantized weights in parameter counts that walk ``named_parameters()``.

A kbit layer holds its weight in buffers (the storage format), so a count of a model's parameters made by walking
``named_parameters()`` (PEFT's ``print_trainable_parameters`` / ``get_nb_trainable_parameters``) would leave the
quantized weights out. Each kbit layer therefore holds, per quantized weight, a frozen parameter named
``<weight>_count`` (``weight_count``, ``gate_up_proj_count``, ``down_proj_count``) with no elements, whose
``ds_numel`` is that weight's element count: the attribute DeepSpeed ZeRO-3 gives a parameter whose values live
elsewhere, which PEFT counts in place of ``numel()`` for an empty parameter.

Holding no values, it changes neither ``state_dict`` (the layers leave it out of saving and loading), nor
``num_parameters()`` / ``get_memory_footprint()`` (which count stored elements and bytes), nor any kernel; it sits
on the layer's device and is never cast (a layer rebuilds it after a device move).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def count_name(weight: str) -> str:
    """The name of the parameter that counts the quantized weight ``weight``."""
    return f"{weight}_count"


def hold_count(module: nn.Module, name: str, numel: int, dtype: torch.dtype, device) -> None:
    """Give ``module`` the empty parameter ``name`` standing for ``numel`` quantized elements on ``device`` (the one
    it holds is kept when it already does: a parameter's identity is what optimizers and hooks key on)."""
    held = module._parameters.get(name)
    if (held is not None and getattr(held, "ds_numel", None) == numel and held.device == torch.device(device)
            and held.dtype == dtype):
        return
    count = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
    count.ds_numel = numel
    module._parameters[name] = count  # not register_parameter: the kbit layers refuse assignments to weight names


@contextmanager
def counts_hidden(module: nn.Module, names):
    """``module`` without its count parameters ``names`` inside the block (saving, loading and moving the module:
    they hold nothing to save, load or move), put back after it at the end of ``_parameters``, where the layers
    register them."""
    held = {name: module._parameters.pop(name) for name in names if name in module._parameters}
    try:
        yield
    finally:
        module._parameters.update(held)
