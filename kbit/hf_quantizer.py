"""kbit as a transformers quantization method: ``KbitConfig`` and ``KbitHfQuantizer`` (``quant_method="kbit"``).

    model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=kbit.KbitConfig(bits=4))
    model.save_pretrained(out)                           # quantization_config in config.json, sharded safetensors
    model = AutoModelForCausalLM.from_pretrained(out)    # kbit layers again (after ``import kbit``)

Quantizing while loading: every eligible ``nn.Linear`` or ``Conv1D`` weight (``kbit.nn.linear_targets``) is
quantized the moment transformers reads it from the checkpoint, and its layer replaced by a ``KbitLinear`` right
then (``kbit.hf_quantize_op``), so host memory peaks near the quantized model plus one layer in full precision.
Loading a kbit folder builds ``KbitLinear`` modules for the layers the checkpoint holds quantized
(``kbit.hf_format``) and checks every loaded tensor as untrusted input.

Registration with transformers happens when its quantizers are imported (``kbit._transformers_hook``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from . import hf_format
from ._progress import Progress
from ._validate import check_bits, check_codebook, check_int
from .moe import KbitExperts, find_experts
from .nn import KbitLinear, linear_targets, quantize_model, quantized_fraction

__all__ = ["KbitConfig", "KbitHfQuantizer", "register", "record_quantization", "default_skip"]

QUANT_METHOD = "kbit"
logger = logging.getLogger("kbit")


class KbitConfig(QuantizationConfigMixin):
    """kbit's settings for ``from_pretrained(..., quantization_config=KbitConfig(...))``; saved in config.json.

    Args:
        bits: bits per weight, 2..5.
        skip: module names, name suffixes or fnmatch patterns kept in full precision (as ``kbit.quantize_model``);
            default (None): ``lm_head``, the output embeddings, weights tied to others and the model's
            ``_keep_in_fp32_modules``.
        min_features: layers with ``min(in_features, out_features)`` below this stay in full precision.
        codebook: a custom codebook, 2**bits sorted values with max |value| 1; default: normal-float.

    ``format_version`` is the version of the saved format; a folder from a newer kbit is refused with a message.
    """

    def __init__(self, bits: int = 4, skip=None, min_features: int = 128, codebook=None,
                 format_version: int = hf_format.FORMAT_VERSION, quant_method: str = QUANT_METHOD,
                 kbit_version: Optional[str] = None):
        from . import __version__

        if quant_method != QUANT_METHOD:
            raise ValueError(f"KbitConfig is for quant_method={QUANT_METHOD!r}, got {quant_method!r}")
        format_version = check_int(format_version, "format_version", 1)
        if format_version > hf_format.FORMAT_VERSION:
            raise ValueError(f"this kbit folder has format_version {format_version}, written by kbit {kbit_version}; "
                             f"kbit {__version__} reads up to {hf_format.FORMAT_VERSION}: upgrade kbit")
        self.quant_method = QUANT_METHOD
        self.bits = check_bits(bits)
        self.skip = None if skip is None else ([skip] if isinstance(skip, str) else [str(s) for s in skip])
        self.min_features = check_int(min_features, "min_features", 0)
        self.codebook = None if codebook is None else check_codebook(torch.as_tensor(codebook), self.bits).tolist()
        self.format_version = format_version
        self.kbit_version = kbit_version or __version__

    def codebook_tensor(self) -> Optional[torch.Tensor]:
        return None if self.codebook is None else torch.tensor(self.codebook, dtype=torch.float32)

    def to_diff_dict(self) -> dict:  # every field: early transformers 5.x have no default for this
        return self.to_dict()


def default_skip(model: torch.nn.Module) -> list:
    """What ``KbitConfig(skip=None)`` keeps in full precision (see ``KbitConfig``)."""
    names = {"lm_head"}
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if output is not None:
        names.update(name for name, m in model.named_modules() if m is output and name)
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    names.update(key.rpartition(".")[0] for pair in tied.items() for key in pair)
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        names.update(getattr(model, attr, None) or ())
    return sorted(n for n in names if n)


class KbitHfQuantizer(HfQuantizer):
    """transformers' hooks for kbit (module docstring); built by ``from_pretrained`` from a ``KbitConfig``."""

    requires_calibration = False
    quantization_config: KbitConfig

    def __init__(self, quantization_config: KbitConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._targets = frozenset()  # quantizing while loading: names of the layers to quantize
        self._skip = []
        self._saved_names = []  # loading a kbit folder: the quantized layers' names in its checkpoint
        self.progress = Progress(0, "", enabled=False)

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("kbit layers cannot be offloaded to disk: give device_map only cpu and cuda devices")

    @property
    def quantized_element_size(self) -> float:  # transformers' memory planning for weights quantized on load
        return self.quantization_config.bits / 8

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if self.pre_quantized:
            layers = hf_format.checkpoint_layers(checkpoint_files)
            hf_format.swap_in_kbit_layers(model, layers)
            self._saved_names = sorted(layers)
            return
        config = self.quantization_config
        self._skip = skip = default_skip(model) if config.skip is None else config.skip
        targets, _, _ = linear_targets(model, skip, config.min_features)
        self._targets = frozenset(name for name, _ in targets)
        # transformers draws its own loading bar; kbit's count goes to its logger (python -m kbit shows it in logs).
        self.progress = Progress(len(self._targets), "kbit: quantized while loading", bar=False, log=logger.info)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module_name, _, tensor_name = param_name.rpartition(".")
        return not self.pre_quantized and tensor_name == "weight" and module_name in self._targets

    def get_quantize_ops(self):
        from .hf_quantize_op import QuantizeWhileLoading

        return QuantizeWhileLoading(self)

    def get_weight_conversions(self):
        return [hf_format.packed_renaming(self._saved_names)] if self._saved_names else []

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            hf_format.check_loaded_layers(model)
            return model
        config = self.quantization_config
        if find_experts(model):  # fused MoE experts arrive as whole 3-D tensors: quantized once all are loaded
            quantize_model(model, bits=config.bits, codebook=config.codebook_tensor(), skip=self._skip,
                           min_features=config.min_features, progress=False)
        layers = sum(isinstance(m, (KbitLinear, KbitExperts)) for m in model.modules())
        summary = (f"kbit: {100 * quantized_fraction(model):.1f}% of {type(model).__name__}'s weights quantized to "
                   f"{config.bits} bits ({layers} layers)")
        logger.info(summary)
        return model

    def get_state_dict_and_metadata(self, model, *args, **kwargs):
        return hf_format.saved_state_dict(model), {}

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:  # adapters (PEFT LoRA, kbit.lora) train through kbit.matmul
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    """Make ``quant_method="kbit"`` known to transformers (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(KbitConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(KbitHfQuantizer)


def record_quantization(model, bits: int, skip, min_features: int, codebook=None) -> None:
    """Mark a transformers model quantized by ``kbit.quantize_model`` as kbit-quantized, as ``from_pretrained``
    would have: ``save_pretrained`` then writes ``quantization_config`` and the kbit weight names."""
    if isinstance(getattr(model, "hf_quantizer", None), KbitHfQuantizer):
        return  # loaded through kbit's quantizer: its config describes the model
    config = KbitConfig(bits=bits, skip=skip, min_features=min_features, codebook=codebook)
    model.config.quantization_config = config
    model.hf_quantizer = KbitHfQuantizer(config, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD


register()
