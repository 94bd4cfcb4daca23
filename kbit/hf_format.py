"""A kbit folder: transformers' format (config.json + sharded safetensors) with kbit layers in it.

For each ``KbitLinear`` ``X`` the weights hold ``X.weight`` (the ``packed`` bit planes: int32, 1-D), ``X.absmax``,
``X.codebook``, ``X.scale``, ``X.meta`` and ``X.bias`` if the layer has one: the layer's ``state_dict`` with
``packed`` saved under the layer's weight name. A transformers without kbit therefore finds ``X.weight`` with the
wrong shape and refuses the folder ("size mismatch") instead of loading random weights in the layer's place.
``config.json`` carries ``quantization_config`` (``kbit.KbitConfig``).

Loading reads which layers are quantized -- and their bits, shape and dtype -- from the checkpoint itself (the
layers with ``.absmax`` and ``.meta`` entries), puts ``KbitLinear`` modules of those shapes into the empty model,
has transformers load ``X.weight`` into ``X.packed``, and then checks every layer's tensors as untrusted input
(``KbitLinear.load_state_dict``).
"""

from __future__ import annotations

import re

from torch import nn

from ._layers import linear_features
from ._validate import check_meta
from .formats import STATE_KEYS
from .moe import KbitExperts
from .nn import KbitLinear

FORMAT_VERSION = 1
# A layer's saved entries: its state keys with ``packed`` saved under the layer's weight name.
_SAVED = tuple("weight" if key == "packed" else key for key in STATE_KEYS)


def saved_state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` with each kbit layer's ``packed`` under the layer's weight name."""
    if any(isinstance(m, KbitExperts) for m in model.modules()):
        # transformers would write them under names neither it nor kbit reads back: refuse rather than lose them
        raise NotImplementedError(
            "a kbit folder cannot hold quantized mixture-of-experts layers (kbit.KbitExperts) yet; keep the "
            "full-precision checkpoint and quantize while loading it: "
            "from_pretrained(..., quantization_config=KbitConfig())"
        )
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, KbitLinear):
            prefix = f"{name}." if name else ""
            state[prefix + "weight"] = state.pop(prefix + "packed")
    return state


def checkpoint_layers(checkpoint_files) -> dict:
    """``{name: (bits, (out_features, in_features), dtype, has_bias)}`` of the kbit layers in a checkpoint."""
    from safetensors import safe_open

    files = [str(f) for f in checkpoint_files or ()]
    not_safetensors = [f for f in files if not f.endswith(".safetensors")]
    if not files or not_safetensors:
        raise ValueError(f"a kbit checkpoint is safetensors files, got {not_safetensors or 'none'}")
    file_of = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            file_of.update(dict.fromkeys(f.keys(), path))
    names = sorted(key[: -len(".absmax")] for key in file_of if key.endswith(".absmax"))
    if not names:
        raise ValueError("the checkpoint has quant_method 'kbit' in its config but no kbit layers in its weights")
    for name in names:
        missing = [f"{name}.{entry}" for entry in _SAVED if f"{name}.{entry}" not in file_of]
        if missing:
            raise ValueError(f"kbit checkpoint: layer {name} lacks {', '.join(missing)}")
    metas = {}
    for path in files:  # each file opened once: a large model has hundreds of layers in a few shards
        keys = [f"{name}.meta" for name in names if file_of[f"{name}.meta"] == path]
        if keys:
            with safe_open(path, framework="pt") as f:
                metas.update((key, check_meta(f.get_tensor(key), key)) for key in keys)
    return {name: (*metas[f"{name}.meta"], f"{name}.bias" in file_of) for name in names}


def _module_name(saved: str, modules: dict, prefix: str) -> str:
    """The model's name for a layer saved as ``saved`` (a checkpoint of the base model, or of a model around it)."""
    candidates = [saved]
    if prefix:
        candidates += [saved[len(prefix) + 1:]] if saved.startswith(prefix + ".") else [f"{prefix}.{saved}"]
    for name in candidates:
        if name in modules:
            return name
    raise ValueError(f"the checkpoint quantizes {saved}, which this model does not have")


def swap_in_kbit_layers(model: nn.Module, layers: dict) -> None:
    """Replace each layer the checkpoint holds quantized by an empty (meta) ``KbitLinear`` of its shape."""
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "") or ""
    for saved, (bits, (out_features, in_features), dtype, has_bias) in layers.items():
        name = _module_name(saved, modules, prefix)
        old = modules[name]
        if linear_features(old) != (in_features, out_features) or (old.bias is not None) != has_bias:
            raise ValueError(
                f"the checkpoint holds {name} as a [{out_features}, {in_features}] kbit layer "
                f"{'with' if has_bias else 'without'} bias, but this model's {name} is {old}"
            )
        new = KbitLinear(in_features, out_features, bias=False, bits=bits, dtype=dtype, device="meta")
        if has_bias:
            new.bias = old.bias  # the model's (meta) bias, in the dtype from_pretrained was asked for
        model.set_submodule(name, new)


def packed_renaming(saved_names):
    """The renaming that loads each saved ``X.weight`` of a kbit layer into ``X.packed``."""
    from transformers.core_model_loading import WeightRenaming

    alternatives = "|".join(re.escape(name) for name in saved_names)
    return WeightRenaming(source_patterns=rf"^({alternatives})\.weight", target_patterns=r"\1.packed")


def check_loaded_layers(model: nn.Module) -> None:
    """Check every kbit layer's loaded tensors (dtype, shape, values) and derive its view and GEMM layout."""
    for name, module in model.named_modules():
        if isinstance(module, KbitLinear):
            try:  # through KbitLinear's checked loading; assign keeps the tensors, no copy
                module.load_state_dict(module.state_dict(), assign=True)
            except RuntimeError as e:
                raise ValueError(f"kbit checkpoint, layer {name}: {e}") from None
