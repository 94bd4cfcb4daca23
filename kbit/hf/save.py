"""transformers helpers: an atomic ``save_pretrained`` for kbit models, and building a model from a config.

    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=kbit.KbitConfig(bits=4))
    kbit.save_quantized(model, "out/")     # model.save_pretrained("out/"), all or nothing

Loading is transformers' own: ``AutoModelForCausalLM.from_pretrained("out/")`` (see ``kbit.hf.quantizer``).
``transformers`` is optional: this module imports it only inside the functions that need it.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from .._atomic import atomic_directory
from ..model_card import README, write_model_card

__all__ = ["save_quantized", "check_ties", "check_loads", "from_config", "dtype_kwarg"]


def save_quantized(model: nn.Module, out_dir: Union[str, os.PathLike], **save_pretrained_kwargs) -> Path:
    """``model.save_pretrained(out_dir, ...)`` for a kbit-quantized transformers model, atomically.

    Every file is written into a temporary sibling directory that then takes ``out_dir``'s place
    (``kbit._atomic``): a save killed at any point leaves the previous checkpoint whole, never a mix of two.
    Files of a previous ``out_dir`` that the save does not write (a tokenizer) are kept. Its README.md starts with
    how to load the folder (``kbit.model_card``). Returns the directory.
    Nothing that does not load is written: a quantized layer whose weight is tied to another is refused before
    writing (``check_ties``), and the written folder must load back structurally before the swap (``check_loads``).
    """
    from .quantizer import KbitHfQuantizer

    if not isinstance(getattr(model, "hf_quantizer", None), KbitHfQuantizer) or not hasattr(model, "save_pretrained"):
        raise ValueError(
            f"{type(model).__name__} is not a kbit-quantized transformers model: load it with "
            "from_pretrained(..., quantization_config=kbit.KbitConfig(bits=...)) or run kbit.quantize_model on it"
        )
    if save_pretrained_kwargs.get("push_to_hub"):
        raise ValueError("save_quantized writes a local folder; push it with model.push_to_hub(repo_id)")
    check_ties(model)
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp, **save_pretrained_kwargs)
        write_model_card(tmp, previous=out / README)
        check_loads(model, tmp)
    return out


def check_ties(model: nn.Module) -> None:
    """Refuse a model with a quantized layer whose weight transformers ties to another: the tie is broken and
    ``from_pretrained`` could not load its folder ('weight' is not an nn.Parameter)."""
    from ..moe import KbitExperts
    from ..nn import KbitLinear, tied_weights

    for name, (key, partner) in tied_weights(model).items():
        if isinstance(model.get_submodule(name), (KbitLinear, KbitExperts)):
            raise ValueError(
                f"cannot save {type(model).__name__}: {key} is tied to {partner} but {name} is quantized, so "
                "the saved folder would not load; keep it in full precision (kbit.quantize_model and KbitConfig do) "
                "- nothing written")


def check_loads(model: nn.Module, folder: Path) -> None:
    """Load the folder just written as ``from_pretrained`` would, on the meta device (names, shapes and dtypes; no
    tensor data is read): ValueError if it fails or reports missing, unexpected or mismatched keys."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    problem = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, info = type(model).from_pretrained(str(folder), device_map="meta", output_loading_info=True,
                                                  ignore_mismatched_sizes=True)  # reported in info, not raised
        problem = "; ".join(f"{kind.replace('_', ' ')}: {', '.join(map(str, list(keys)[:4]))}"
                            + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
                            for kind, keys in info.items() if keys) or None
    except Exception as e:  # noqa: BLE001 - whatever the loader raises, the folder does not load
        lines = str(e).strip().splitlines()
        problem = f"{type(e).__name__}: {lines[0] if lines else ''}"
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if problem:
        raise ValueError(f"the checkpoint written does not load back ({problem}); nothing was replaced")


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
