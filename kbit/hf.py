"""transformers helpers: an atomic ``save_pretrained`` for kbit models, and building a model from a config.

    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=kbit.KbitConfig(bits=4))
    kbit.save_quantized(model, "out/")     # model.save_pretrained("out/"), all or nothing

Loading is transformers' own: ``AutoModelForCausalLM.from_pretrained("out/")`` (see ``kbit.hf_quantizer``).
``transformers`` is optional: this module imports it only inside the functions that need it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ._atomic import atomic_directory
from .model_card import README, write_model_card

__all__ = ["save_quantized", "from_config", "dtype_kwarg"]


def save_quantized(model: nn.Module, out_dir: Union[str, os.PathLike], **save_pretrained_kwargs) -> Path:
    """``model.save_pretrained(out_dir, ...)`` for a kbit-quantized transformers model, atomically.

    Every file is written into a temporary sibling directory that then takes ``out_dir``'s place
    (``kbit._atomic``): a save killed at any point leaves the previous checkpoint whole, never a mix of two.
    Files of a previous ``out_dir`` that the save does not write (a tokenizer) are kept. Its README.md starts with
    how to load the folder (``kbit.model_card``). Returns the directory.
    """
    from .hf_quantizer import KbitHfQuantizer

    if not isinstance(getattr(model, "hf_quantizer", None), KbitHfQuantizer) or not hasattr(model, "save_pretrained"):
        raise ValueError(
            f"{type(model).__name__} is not a kbit-quantized transformers model: load it with "
            "from_pretrained(..., quantization_config=kbit.KbitConfig(bits=...)) or run kbit.quantize_model on it"
        )
    if save_pretrained_kwargs.get("push_to_hub"):
        raise ValueError("save_quantized writes a local folder; push it with model.push_to_hub(repo_id)")
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp, **save_pretrained_kwargs)
        write_model_card(tmp, previous=out / README)
    return out


def _transformers_version() -> tuple:
    import transformers

    return tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])


def dtype_kwarg() -> str:
    """Name of the dtype argument of ``from_pretrained`` / ``_from_config``: ``dtype`` since
    transformers 4.56, ``torch_dtype`` before."""
    return "dtype" if _transformers_version() >= (4, 56) else "torch_dtype"


def from_config(model_class, config, dtype: Optional[torch.dtype] = None, attn_implementation: Optional[str] = None):
    """``model_class._from_config(config, dtype=...)``: a randomly initialized model of ``config``.

    ``_from_config`` (unlike ``model_class(config)``) picks the attention implementation (sdpa)
    the way ``from_pretrained`` does.
    """
    kwargs = {}
    if dtype is not None:
        kwargs[dtype_kwarg()] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return model_class._from_config(config, **kwargs)
