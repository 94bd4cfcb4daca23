"""A kbit folder: transformers' format (config.json + sharded safetensors) with kbit layers in it.

For each ``KbitLinear`` ``X`` the weights hold ``X.weight`` (the ``packed`` bit planes: int32, 1-D), ``X.absmax``,
``X.codebook``, ``X.scale``, ``X.meta`` and ``X.bias`` if the layer has one: the layer's ``state_dict`` with
``packed`` saved under the layer's weight name. A transformers without kbit therefore finds ``X.weight`` with the
wrong shape and refuses the folder ("size mismatch") instead of loading random weights in the layer's place.
For each ``KbitExperts`` ``X`` (a mixture-of-experts layer's routed experts) they hold its ``state_dict``:
``X.gate_up_packed``, ``X.gate_up_absmax``, ``X.gate_up_scale``, the same three for ``down``, ``X.codebook`` and
``X.meta`` (layout in ``kbit.moe``). A ``KbitLinear`` quantized in a rotated basis (``kbit.rotation``) also holds
``X.rotation_signs`` and ``X.rotation_block``. ``config.json`` carries ``quantization_config`` (``kbit.KbitConfig``).

Names are the model's own, after ``save_pretrained`` applied the model's renamings back to the original
checkpoint's names (Mixtral's ``mlp`` is saved as ``block_sparse_moe``); loading applies them forward again.

Loading reads which layers are quantized -- and their bits, shapes and dtype -- from the checkpoint itself (the
``.absmax`` and ``.meta`` entries of each ``KbitLinear``, the ``.gate_up_absmax`` and ``.meta`` entries of each
``KbitExperts``), puts empty kbit modules of those shapes into the model, has transformers load ``X.weight`` into
``X.packed`` and the rest by name, and then checks every kbit module's tensors as untrusted input
(``load_state_dict``). What transformers' loader would hide is checked before it runs: each kbit entry's dtype as
the file stores it (the loader casts to the module's buffers), a rotated layer's two rotation entries, files that
cannot be read (named).
"""

from __future__ import annotations

import contextlib
import re

from torch import nn

from .._layers import linear_features
from .._validate import check_experts_meta, check_meta, check_saved_dtype
from ..formats import STATE_KEYS
from ..moe import STORAGE as EXPERTS_STORAGE
from ..moe import KbitExperts, experts_shape, unsupported_reason
from ..nn import KbitLinear
from ..rotation import choose_block

FORMAT_VERSION = 1
# A layer's saved entries: its state keys with ``packed`` saved under the layer's weight name.
_SAVED = tuple("weight" if key == "packed" else key for key in STATE_KEYS)
_ROTATION = ("rotation_signs", "rotation_block")  # a rotated layer's further entries: both or neither


def saved_state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` with each ``KbitLinear``'s ``packed`` under the layer's weight name.

    A kbit layer on the GPU derives its storage format from its GEMM layout for the state dict; each derived tensor
    moves to the CPU as soon as its layer is saved, so that saving never holds a second copy of the model's codes on
    the GPU (only one layer's)."""
    hooks = [module.register_state_dict_post_hook(_derived_to_cpu) for module in model.modules()
             if isinstance(module, (KbitLinear, KbitExperts)) and module.is_gemm_resident]
    try:
        state = model.state_dict()
    finally:
        for hook in hooks:
            hook.remove()
    for name, module in model.named_modules():
        if isinstance(module, KbitLinear):
            prefix = f"{name}." if name else ""
            state[prefix + "weight"] = state.pop(prefix + "packed")
    return state


def _derived_to_cpu(module, state, prefix, local_metadata) -> None:
    for key in module.DERIVED_KEYS:
        state[prefix + key] = state[prefix + key].cpu()


def model_renamings(model: nn.Module) -> list:
    """The renamings transformers applies to this model's checkpoint keys while loading (and backwards on saving)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]


def renamed_key(key: str, renamings) -> str:
    """``key`` after every renaming in turn, as transformers renames checkpoint keys (its own helper for this
    is newer than the oldest transformers kbit supports; each renaming's method is not)."""
    for renaming in renamings:
        key = renaming.rename_source_key(key)[0]
    return key


@contextlib.contextmanager
def _opened(path: str):
    """``safe_open(path)``, its errors naming the file (safetensors' own messages do not: a truncated shard)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"kbit checkpoint: cannot read {path}: {e}") from e


def checkpoint_modules(checkpoint_files, renamings=()) -> tuple:
    """The kbit modules in a checkpoint, named as ``renamings`` (``model_renamings``) rename its keys:
    ``({name: (bits, (out_features, in_features), dtype, has_bias, rotated)}`` of each ``KbitLinear``,
    ``{name: (bits, E, H, I, dtype)}`` of each ``KbitExperts``).

    Each kbit entry's dtype is checked as the file stores it (``check_saved_dtype``): transformers casts what it
    loads to the module's buffers, so the checks after loading could not tell int32 codes from float ones."""
    files = [str(f) for f in checkpoint_files or ()]
    not_safetensors = [f for f in files if not f.endswith(".safetensors")]
    if not files or not_safetensors:
        raise ValueError(f"a kbit checkpoint is safetensors files, got {not_safetensors or 'none'}")
    file_of, stored = {}, {}  # renamed key -> (file, key in the file); -> its dtype in the file ("I32", ...)
    for path in files:
        with _opened(path) as f:
            for key in f.keys():
                name = renamed_key(key, renamings)
                file_of[name], stored[name] = (path, key), f.get_slice(key).get_dtype()
    layers = sorted(key[: -len(".absmax")] for key in file_of if key.endswith(".absmax"))
    experts = sorted(key[: -len(".gate_up_absmax")] for key in file_of if key.endswith(".gate_up_absmax"))
    if not layers and not experts:
        raise ValueError("the checkpoint has quant_method 'kbit' in its config but no kbit layers in its weights")
    rotated = {name for name in layers if any(f"{name}.{entry}" in file_of for entry in _ROTATION)}
    for name in layers + experts:
        entries = EXPERTS_STORAGE if name in experts else _SAVED + (_ROTATION if name in rotated else ())
        missing = [f"{name}.{entry}" for entry in entries if f"{name}.{entry}" not in file_of]
        if missing:  # half a rotation too: without its signs the layer would load as unrotated
            raise ValueError(f"kbit checkpoint: layer {name} lacks {', '.join(missing)}")
        for entry in entries:
            check_saved_dtype("packed" if entry == "weight" else entry, stored[f"{name}.{entry}"], f"{name}.{entry}")
    metas = {}
    for path in files:  # each file opened once: a large model has hundreds of layers in a few shards
        keys = [f"{name}.meta" for name in layers + experts if file_of[f"{name}.meta"][0] == path]
        if keys:
            with _opened(path) as f:
                metas.update((key, f.get_tensor(file_of[key][1])) for key in keys)
    return ({name: (*check_meta(metas[f"{name}.meta"], f"{name}.meta"), f"{name}.bias" in file_of, name in rotated)
             for name in layers},
            {name: check_experts_meta(metas[f"{name}.meta"], f"{name}.meta") for name in experts})


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
    for saved, (bits, (out_features, in_features), dtype, has_bias, rotated) in layers.items():
        name = _module_name(saved, modules, prefix)
        old = modules[name]
        if linear_features(old) != (in_features, out_features) or (old.bias is not None) != has_bias:
            raise ValueError(
                f"the checkpoint holds {name} as a [{out_features}, {in_features}] kbit layer "
                f"{'with' if has_bias else 'without'} bias, but this model's {name} is {old}"
            )
        # a rotated layer's block is a placeholder here: the checkpoint's rotation_block replaces it
        block = choose_block(in_features) if rotated else 0
        if block == 1:
            raise ValueError(f"the checkpoint holds {name} rotated, but its in_features={in_features} admits no "
                             "rotation")
        new = KbitLinear.from_checked(in_features, out_features, False, bits, dtype, "meta", rotation_block=block)
        if has_bias:
            new.bias = old.bias  # the model's (meta) bias, in the dtype from_pretrained was asked for
        model.set_submodule(name, new)


def swap_in_kbit_experts(model: nn.Module, experts: dict) -> None:
    """Replace each fused experts module the checkpoint holds quantized by an empty (meta) ``KbitExperts``."""
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "") or ""
    for saved, (bits, E, H, I, dtype) in experts.items():
        name = _module_name(saved, modules, prefix)
        old = modules[name]
        why = unsupported_reason(old)
        if why or experts_shape(old) != (E, H, I):
            raise ValueError(f"the checkpoint holds {name} as kbit experts E={E}, H={H}, I={I}, but this model's "
                             f"{name} is {why or f'E, H, I = {experts_shape(old)}'}")
        model.set_submodule(name, KbitExperts.from_checked(E, H, I, bits, dtype, "meta", act_fn=old.act_fn))


def packed_renaming(saved_names):
    """The renaming that loads each saved ``X.weight`` of a ``KbitLinear`` into ``X.packed`` (``saved_names``: the
    layers' names once the model's renamings have applied, which run before this one)."""
    from transformers.core_model_loading import WeightRenaming

    alternatives = "|".join(re.escape(name) for name in saved_names)
    return WeightRenaming(source_patterns=rf"^({alternatives})\.weight", target_patterns=r"\1.packed")


def check_loaded_layers(model: nn.Module) -> None:
    """Check every kbit module's loaded tensors (dtype, shape, values) and derive its view and GEMM layout."""
    for name, module in model.named_modules():
        if isinstance(module, (KbitLinear, KbitExperts)):
            try:  # through the module's checked loading; assign keeps the tensors, no copy
                module.load_state_dict(module.state_dict(), assign=True)
            except RuntimeError as e:
                raise ValueError(f"kbit checkpoint, layer {name}: {e}") from None
