"""Hugging Face ``transformers`` integration: save and load kbit-quantized models.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    kbit.quantize_model(model, k=4)          # swaps q/k/v/o, gate/up/down; lm_head stays fp16
    kbit.save_quantized(model, "out/")       # config.json + kbit_config.json + model.safetensors
    model = kbit.load_quantized("out/", device="cuda")   # never materializes fp16 weights

``transformers`` is optional: this module imports it only inside the functions that need it, so
``import kbit`` works without it.

On-disk layout of a saved model (``out_dir``):

* ``config.json`` -- the model's ``transformers`` config (``architectures`` set to the model class).
* ``generation_config.json`` -- when the model has one.
* ``kbit_config.json`` -- the quantization config: ``quant_method = "kbit"``, ``format_version``,
  ``bits`` (an int, or a ``{module: bits}`` map when layers differ), ``codebook``
  (``"normal_float"`` or ``"custom"``; the values themselves are in the weights),
  ``quantized_modules`` (names of the ``KbitLinear`` layers), ``skipped_modules`` (``nn.Linear``
  layers left in high precision, e.g. ``lm_head``), ``tied_tensors`` (``{alias: saved name}``
  for tensors shared under several names, e.g. ``lm_head.weight`` -> ``model.embed_tokens.weight``)
  and ``model_class``. The same JSON is stored in the safetensors header under ``"kbit"``, so
  the weights file describes itself.
* ``model.safetensors`` -- ``model.state_dict()``: each ``KbitLinear`` contributes
  ``<name>.packed/.absmax/.codebook/.scale/.meta`` (and ``.bias``), every other tensor is saved
  as it is in memory. A tensor shared under several names (tied embeddings) is written once.

Loading builds the model skeleton with every parameter on the ``meta`` device (buffers such as
rotary frequencies stay real, as ``accelerate.init_empty_weights`` does), replaces the quantized
``nn.Linear`` layers with ``KbitLinear`` modules of the right shape (also on ``meta``), then
assigns the saved tensors (``load_state_dict(assign=True)``), so peak memory is the size of the
quantized model, not of the fp16 one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ._atomic import atomic_directory

__all__ = ["save_quantized", "load_quantized", "init_empty_weights", "default_skip", "KBIT_CONFIG_NAME",
           "WEIGHTS_NAME"]

KBIT_CONFIG_NAME = "kbit_config.json"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FORMAT_VERSION = 1
_KBIT_KEYS = ("packed", "absmax", "codebook", "scale", "meta")
# Tensors shared under several names are written once (and re-tied on load) when they are larger
# than this; smaller ones (a KbitLinear's codebook, say) are simply written under every name.
_ALIAS_MIN_BYTES = 1 << 16


# ---------------------------------------------------------------------- transformers helpers
def _require_transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "this kbit feature needs Hugging Face transformers: pip install transformers"
        ) from e
    return transformers


def _transformers_version() -> tuple:
    transformers = _require_transformers()
    return tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])


def dtype_kwarg() -> str:
    """Name of the dtype argument of ``from_pretrained`` / ``_from_config``: ``dtype`` since
    transformers 4.56, ``torch_dtype`` before."""
    return "dtype" if _transformers_version() >= (4, 56) else "torch_dtype"


def _is_config(obj) -> bool:
    return hasattr(obj, "to_dict") and hasattr(obj, "model_type") and not isinstance(obj, (str, os.PathLike))


def resolve_model_class(config, model_class=None):
    """The ``transformers`` model class to build for ``config``, or None.

    Tries ``model_class`` (a class or a class name), then ``config.architectures``, then the
    causal-LM and base-model auto mappings.
    """
    transformers = _require_transformers()
    if isinstance(model_class, type):
        return model_class
    names = [model_class] if model_class else []
    names += list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type):
            return cls
    for auto_name in ("AutoModelForCausalLM", "AutoModel"):
        auto = getattr(transformers, auto_name, None)
        try:
            return auto._model_mapping[type(config)]
        except Exception:
            continue
    return None


def from_config(model_class, config, dtype: Optional[torch.dtype] = None, attn_implementation: Optional[str] = None):
    """``model_class._from_config(config, dtype=...)`` across transformers 4.4x and 5.x.

    ``_from_config`` (unlike ``model_class(config)``) picks the attention implementation (sdpa)
    the way ``from_pretrained`` does.
    """
    kwargs = {}
    if dtype is not None:
        kwargs[dtype_kwarg()] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if getattr(config, "_attn_implementation_autoset", False):
        # transformers 4.45-4.47 write this flag into config.json; a config read back with it set
        # skips choosing sdpa and falls back to eager attention. Let _from_config choose again.
        config._attn_implementation_autoset = False
    build = getattr(model_class, "_from_config", None)
    if build is None:  # not a PreTrainedModel
        with _default_dtype(dtype):
            return model_class(config)
    return build(config, **kwargs)


@contextlib.contextmanager
def _default_dtype(dtype: Optional[torch.dtype]):
    if dtype is None or not dtype.is_floating_point:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def init_empty_weights():
    """Build modules with every parameter on the ``meta`` device (no memory, no initialization).

    Buffers stay real: non-persistent buffers (rotary ``inv_freq``, BERT ``position_ids``) are
    not in a checkpoint, so they must be computed by the constructor. The same trick as
    ``accelerate.init_empty_weights(include_buffers=False)``, without the dependency.
    """
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            if type(p) is nn.Parameter:
                new = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
            else:  # a Parameter subclass: rebuild it the way accelerate does
                kwargs = dict(p.__dict__)
                kwargs["requires_grad"] = p.requires_grad
                new = type(p)(p.to("meta"), **kwargs)
            module._parameters[name] = new

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def default_skip(model: nn.Module) -> list:
    """Names to keep in high precision by default: ``lm_head`` and the model's output embedding."""
    skip = ["lm_head"]
    get_out = getattr(model, "get_output_embeddings", None)
    out = None
    if callable(get_out):
        try:
            out = get_out()
        except Exception:
            out = None
    if isinstance(out, nn.Module):
        for name, m in model.named_modules():
            if m is out and name and name not in skip:
                skip.append(name)
    return skip


# ---------------------------------------------------------------------- module tree helpers
def _get_parent(model: nn.Module, name: str):
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Point parameter or buffer ``name`` at ``tensor`` (sharing it, as tied weights do)."""
    owner, attr = _get_parent(model, name)
    if attr in owner._parameters:
        owner._parameters[attr] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(
            tensor, requires_grad=False)
    elif attr in owner._buffers:
        owner._buffers[attr] = tensor
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of the model")


def _get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner, attr = _get_parent(model, name)
    if attr in owner._parameters:
        return owner._parameters[attr]
    return owner._buffers[attr]


def _kbit_linear_cls():
    from .nn import KbitLinear

    return KbitLinear


# ---------------------------------------------------------------------- save
def _dedupe(state: dict, param_names=frozenset()):
    """Drop all but the first name of each parameter (or large buffer) stored under several names.

    Returns (tensors to write, {alias: kept name}). safetensors refuses shared storage, and tied
    weights (``lm_head.weight`` is ``model.embed_tokens.weight``) should be written once.
    """
    seen, out, tied = {}, {}, {}
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if t.numel() and (name in param_names or nbytes >= _ALIAS_MIN_BYTES):
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                   t.dtype)
            if key in seen:
                tied[name] = seen[key]
                continue
            seen[key] = name
        out[name] = t
    return out, tied


def _to_saveable(state: dict) -> dict:
    """CPU, contiguous, no two entries sharing storage (small shared tensors are copied)."""
    out, ptrs = {}, set()
    for name, t in state.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and ptr in ptrs:
            t = t.clone()
            ptr = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        ptrs.add(ptr)
        out[name] = t
    return out


def _kbit_config(model: nn.Module, tied: dict, extra: Optional[dict]) -> dict:
    from . import __version__
    from .formats import create_normal_float_codebook

    KbitLinear = _kbit_linear_cls()
    quantized, bits, custom, dtypes, skipped, seen = [], {}, False, set(), [], set()
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, KbitLinear):
            quantized.append(name)
            bits[name] = m.k
            dtypes.add(str(m.weight_dtype).replace("torch.", ""))
            if id(m) not in seen:
                seen.add(id(m))
                ref = create_normal_float_codebook(m.k, device=m.codebook.device)
                if m.codebook.shape != ref.shape or not torch.equal(m.codebook.float(), ref):
                    custom = True
        elif isinstance(m, nn.Linear):
            skipped.append(name)
    uniform = set(bits.values())
    cfg = {
        "quant_method": "kbit",
        "format_version": FORMAT_VERSION,
        "kbit_version": __version__,
        "bits": next(iter(uniform)) if len(uniform) == 1 else bits,
        "block_size": 32,
        "absmax_format": "e4m4",
        "codebook": "custom" if custom else "normal_float",
        "weight_dtype": sorted(dtypes)[0] if len(dtypes) == 1 else sorted(dtypes),
        "model_class": type(model).__name__,
        "weights": WEIGHTS_NAME,
        "quantized_modules": quantized,
        "skipped_modules": skipped,
        "tied_tensors": tied,
    }
    if extra:
        cfg.update(extra)
    return cfg


def _save_configs(model: nn.Module, directory: Path) -> None:
    """``config.json`` and ``generation_config.json`` of a transformers model (nothing for other modules)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        config.architectures = [type(model).__name__]
        if hasattr(config, "_attn_implementation_autoset"):  # transformers 4.45-4.47: not for config.json
            try:
                del config._attn_implementation_autoset
            except AttributeError:
                pass
        config.save_pretrained(directory)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        try:
            can_generate = model.can_generate() if hasattr(model, "can_generate") else True
        except Exception:
            can_generate = False
        if can_generate:
            try:
                gen.save_pretrained(directory)
            except Exception:  # an invalid generation config must not block saving the weights
                pass


def save_quantized(model: nn.Module, out_dir: Union[str, os.PathLike], extra_config: Optional[dict] = None) -> Path:
    """Save a model quantized with ``kbit.quantize_model`` to ``out_dir`` (created if needed).

    Writes ``config.json`` (when the model has a ``transformers`` config), ``kbit_config.json``
    and ``model.safetensors``; see the module docstring for the layout. ``extra_config`` entries
    are added to ``kbit_config.json``. Returns the directory.

    The save is atomic (``kbit._atomic``): every file is written to a temporary sibling directory
    that then takes ``out_dir``'s place, so an interrupted save leaves the previous checkpoint
    intact and loadable, never a mix of the two.
    """
    from safetensors.torch import save_file

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    KbitLinear = _kbit_linear_cls()
    if not any(isinstance(m, KbitLinear) for m in model.modules()):
        raise ValueError("model has no KbitLinear layers: quantize it first with kbit.quantize_model(model, k=...)")
    state = model.state_dict()
    metas = [n for n, t in state.items() if t.device.type == "meta"]
    if metas:
        raise ValueError(f"cannot save tensors on the meta device (no values): {', '.join(metas[:5])}")
    out = Path(out_dir)
    tensors, tied = _dedupe(state, {n for n, _ in model.named_parameters(remove_duplicate=False)})
    kcfg = _kbit_config(model, tied, extra_config)
    with atomic_directory(out) as tmp:
        _save_configs(model, tmp)
        save_file(_to_saveable(tensors), str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "kbit": json.dumps(kcfg)})
        (tmp / KBIT_CONFIG_NAME).write_text(json.dumps(kcfg, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------- load
def _read_kbit_config(weights: Path, directory: Optional[Path]) -> dict:
    from safetensors import safe_open

    if directory is not None and (directory / KBIT_CONFIG_NAME).is_file():
        try:
            return json.loads((directory / KBIT_CONFIG_NAME).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            # The weights file carries the same JSON in its header: a damaged side file loses nothing.
            warnings.warn(f"{directory / KBIT_CONFIG_NAME} is unreadable ({e}); using the copy in {weights.name}'s header",
                          stacklevel=3)
    with safe_open(str(weights), framework="pt") as f:
        meta = f.metadata() or {}
    if "kbit" not in meta:
        raise ValueError(f"{weights} is not a kbit checkpoint (no {KBIT_CONFIG_NAME} and no 'kbit' header entry)")
    return json.loads(meta["kbit"])


def _quantized_layers(state: dict, tied: dict) -> dict:
    """{module name: (k, out_features, in_features, dtype, has_bias)} from the saved ``.meta`` tensors."""
    from ._validate import check_meta

    names = set()
    for key in list(state) + list(tied):
        if key.endswith(".packed"):
            names.add(key[: -len(".packed")])
    layers = {}
    for name in sorted(names):
        meta_key = tied.get(name + ".meta", name + ".meta")
        if meta_key not in state:
            raise ValueError(f"kbit checkpoint has {name}.packed but no {name}.meta")
        k, (N, K), dtype = check_meta(state[meta_key], meta_key)
        bias_key = name + ".bias"
        layers[name] = (k, N, K, dtype, bias_key in state or bias_key in tied)
    return layers


def load_quantized(
    path_or_config=None,
    *,
    weights: Union[str, os.PathLike, None] = None,
    model: Optional[nn.Module] = None,
    device: Union[str, torch.device] = "cpu",
    dtype: Optional[torch.dtype] = None,
    model_class=None,
    attn_implementation: Optional[str] = None,
) -> nn.Module:
    """Load a model saved by ``save_quantized``, without materializing its fp16 weights.

    Args:
        path_or_config: the directory written by ``save_quantized``, or a ``transformers``
            config object (then ``weights`` is required), or None when ``model`` is given.
        weights: the ``model.safetensors`` file (or its directory); default: in ``path_or_config``.
        model: an already-built model (any ``nn.Module``, typically built on the meta device or
            inside ``kbit.hf.init_empty_weights()``) to load into, instead of building one from
            the config.
        device: where the loaded tensors go (``"cuda"`` loads straight onto the GPU).
        dtype: cast the high-precision tensors (embeddings, norms, lm_head, biases) to this dtype;
            default: as saved. The quantized weights are never cast.
        model_class: the ``transformers`` class (or class name) to build; default: the one saved
            in ``kbit_config.json``, then ``config.architectures``, then the auto classes.
        attn_implementation: passed to the model constructor (e.g. ``"sdpa"``, ``"eager"``).

    Returns the model in eval mode.
    """
    from safetensors.torch import load_file

    directory = None
    config = None
    if _is_config(path_or_config):
        config = path_or_config
    elif path_or_config is not None:
        directory = Path(path_or_config)
        if directory.is_file():  # a weights file was passed
            weights, directory = directory, directory.parent
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory} is not a directory written by kbit.save_quantized")
    elif model is None:
        raise ValueError("pass a directory, a transformers config (with weights=...), or model=")

    if weights is None:
        if directory is None:
            raise ValueError("weights= (the model.safetensors file or its directory) is required with a config object")
        weights = directory / WEIGHTS_NAME
    weights = Path(weights)
    if weights.is_dir():
        if directory is None:
            directory = weights
        weights = weights / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no kbit weights file at {weights}")
    kcfg = _read_kbit_config(weights, directory)
    if kcfg.get("quant_method") != "kbit":
        raise ValueError(f"{weights} is not a kbit checkpoint (quant_method={kcfg.get('quant_method')!r})")
    if int(kcfg.get("format_version", 1)) > FORMAT_VERSION:
        raise ValueError(
            f"checkpoint format_version {kcfg['format_version']} is newer than this kbit supports ({FORMAT_VERSION}); "
            "upgrade kbit"
        )
    tied = dict(kcfg.get("tied_tensors") or {})

    device = torch.device(device)
    state = load_file(str(weights), device=str(device))
    layers = _quantized_layers(state, tied)

    if model is None:
        if config is None:
            if directory is None or not (directory / CONFIG_NAME).is_file():
                raise FileNotFoundError(f"no {CONFIG_NAME} next to {weights}: pass the config or model=")
            transformers = _require_transformers()
            config = transformers.AutoConfig.from_pretrained(str(directory))
        cls = resolve_model_class(config, model_class or kcfg.get("model_class"))
        if cls is None:
            raise ValueError(
                f"cannot find a transformers class for model_type={getattr(config, 'model_type', None)!r} "
                f"(architectures={getattr(config, 'architectures', None)}); pass model_class= or model="
            )
        skeleton_dtype = dtype
        if skeleton_dtype is None:
            wd = kcfg.get("weight_dtype")
            skeleton_dtype = getattr(torch, wd) if isinstance(wd, str) and hasattr(torch, wd) else None
        with init_empty_weights():
            model = from_config(cls, config, dtype=skeleton_dtype, attn_implementation=attn_implementation)

    # Swap the quantized Linear layers for KbitLinear modules of the right shape, on meta.
    KbitLinear = _kbit_linear_cls()
    for name, (k, N, K, wdtype, has_bias) in layers.items():
        try:
            parent, child = _get_parent(model, name)
            old = getattr(parent, child)
        except AttributeError:
            raise ValueError(f"the checkpoint quantizes {name}, which this model does not have") from None
        if isinstance(old, KbitLinear):
            if (old.k, old.out_features, old.in_features) == (k, N, K):
                continue
        elif isinstance(old, nn.Linear):
            if (old.out_features, old.in_features) != (N, K):
                raise ValueError(
                    f"{name}: the checkpoint holds a [{N}, {K}] weight but the model's Linear is "
                    f"[{old.out_features}, {old.in_features}]"
                )
        else:
            raise ValueError(f"{name} is a {type(old).__name__} in this model, expected nn.Linear")
        setattr(parent, child, KbitLinear(K, N, bias=has_bias, k=k, dtype=wdtype, device="meta"))

    if dtype is not None:
        quantized_keys = {f"{n}.{s}" for n in layers for s in _KBIT_KEYS}
        for key, t in state.items():
            if key not in quantized_keys and t.is_floating_point() and t.dtype != dtype:
                state[key] = t.to(dtype)

    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"the checkpoint has tensors this model lacks: {', '.join(result.unexpected_keys[:10])}")
    for alias, source in tied.items():
        if source not in state:
            raise ValueError(f"tied tensor {alias} refers to {source}, which the checkpoint lacks")
        _set_tensor(model, alias, _get_tensor(model, source))

    still_meta = [n for n, t in list(model.named_parameters(remove_duplicate=False)) +
                  list(model.named_buffers(remove_duplicate=False)) if t.device.type == "meta"]
    if still_meta:
        raise ValueError(
            f"the checkpoint does not provide {len(still_meta)} tensor(s) of the model: {', '.join(still_meta[:10])}"
        )
    model.to(device)  # buffers the constructor created (rotary inv_freq, ...) follow the weights
    if directory is not None and (directory / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        try:
            transformers = _require_transformers()
            model.generation_config = transformers.GenerationConfig.from_pretrained(str(directory))
        except Exception:
            pass
    model.eval()
    return model
