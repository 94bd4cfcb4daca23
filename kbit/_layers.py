"""The layers kbit quantizes: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2 family).

``Conv1D`` computes ``x @ W + b`` with its weight stored transposed, [in_features, out_features]; kbit stores
every layer in ``nn.Linear``'s layout, [out_features, in_features], so a ``Conv1D`` becomes a ``KbitLinear`` of
its transposed weight and computes the same function.
"""

from __future__ import annotations

import sys
from typing import Optional, Tuple

from torch import Tensor, nn


def is_conv1d(module: nn.Module) -> bool:
    # A Conv1D exists only if transformers defined it, so there is no need to import transformers to ask.
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D)


def linear_features(module: nn.Module) -> Optional[Tuple[int, int]]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``; None for any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        in_features, out_features = module.weight.shape
        return int(in_features), int(out_features)
    return None


def linear_weight(module: nn.Module) -> Tensor:
    """The weight in ``nn.Linear``'s layout, [out_features, in_features] (a transposed view for a ``Conv1D``)."""
    return module.weight.t() if is_conv1d(module) else module.weight
