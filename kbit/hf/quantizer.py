"""kbit as a transformers quantization method: ``KbitConfig`` and ``KbitHfQuantizer`` (``quant_method="kbit"``).

    model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=kbit.KbitConfig(bits=4))
    model.save_pretrained(out)                           # quantization_config in config.json, sharded safetensors
    model = AutoModelForCausalLM.from_pretrained(out)    # kbit layers again (after ``import kbit``)

Quantizing while loading: every eligible ``nn.Linear`` or ``Conv1D`` weight (``kbit.nn.linear_targets``) is
quantized the moment transformers reads it from the checkpoint, and its layer replaced by a ``KbitLinear`` right
then (``kbit.hf.quantize_op``); so is each projection of a fused mixture-of-experts module
(``kbit.nn.experts_targets``: ``gate_up_proj`` and ``down_proj``, each assembled by transformers from the
checkpoint's per-expert weights), the module replaced by a ``KbitExperts`` once both are in. Host memory
peaks near the quantized model plus one layer in full precision. The other methods (``"mse"``, ``"gptq"``) go
through ``kbit.quantize_model`` once the checkpoint is loaded in full precision (gptq needs every layer's inputs,
which only the whole model produces, and runs block by block, as transformers' GPTQ integration does), so host
memory peaks at the full-precision model plus its quantized copy. Loading a kbit folder builds ``KbitLinear`` and
``KbitExperts`` modules for the layers the checkpoint holds quantized (``kbit.hf.folder``) and checks every loaded
tensor as untrusted input.

Registration with transformers happens when its quantizers are imported (``kbit.hf.hook``).
"""

from __future__ import annotations

import inspect
import logging
import warnings
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

from . import folder
from .._progress import Progress
from .._validate import check_int, check_skip, codebook_values
from .._version import __version__
from ..bit_budget import check_bits_setting
from ..calibration import check_calibration, check_calibration_used, check_gptq_refinements
from ..calibration_text import is_text
from ..finetune import check_tune_steps
from ..fusion import FUSE_BY_DEFAULT
from ..methods import check_method
from ..moe import FUSED_PARAMETERS, KbitExperts
from ..nn import KbitLinear, experts_targets, fuse_projections, linear_targets, quantize_model, quantized_fraction

__all__ = ["KbitConfig", "KbitHfQuantizer", "register", "record_quantization", "default_skip"]

QUANT_METHOD = "kbit"
logger = logging.getLogger("kbit")


RUNTIME_SETTINGS = ("calibration", "fuse_projections")  # KbitConfig's settings that config.json does not keep


class KbitConfig(QuantizationConfigMixin):
    """kbit's settings for ``from_pretrained(..., quantization_config=KbitConfig(...))``; saved in config.json.

    Args:
        bits: bits per weight, 2..5; or a float budget of average bits per weight, or a dict {layer name or
            pattern: K} (``kbit.quantize_model``'s per-layer bits: the model is then loaded in full precision and
            quantized once loaded, with kbit's built-in calibration text and the model's tokenizer).
        skip: module names, name suffixes or fnmatch patterns kept in full precision (as ``kbit.quantize_model``);
            default (None): ``lm_head``, the output embeddings and the model's ``_keep_in_fp32_modules``. Weights
            tied to others stay in full precision whatever ``skip`` says (``kbit.nn.tied_weights``).
        min_features: layers with ``min(in_features, out_features)`` below this stay in full precision.
        codebook: a custom codebook, 2**bits sorted values with max |value| 1; default: normal-float.
        rotate: quantize each layer in a rotated basis of its input features (as ``kbit.quantize_model``).
        method: ``"rtn"`` (default, quantized as each weight is read), ``"mse"`` (data-free, fitted codebooks) or
            ``"gptq"`` (calibrated; ``method="gptq", rotate=True`` is the most accurate, docs/QUALITY.md); the
            last two quantize the loaded model (module docstring). Saved in config.json.
        calibration: what ``method="gptq"``, a bit budget and ``tune_steps`` run through the model
            (``kbit.quantize_model``'s forms: token ids [n_seq, seq_len], a list of dicts of model inputs, or
            text (a str or a list of short texts), tokenized with the model's tokenizer and mixed with kbit's
            built-in text); default: the built-in
            text alone; used by no other setting, never saved.
        tune_steps: end-to-end tuning steps after quantizing (``kbit.quantize_model``'s, ``kbit.finetune``; 0, the
            default: none); with tuning the model is quantized once loaded.
        fuse_projections: sibling projections that read the same input (q/k/v, gate/up) run as one GEMM launch
            where that is exact (``kbit.fuse_projections``); how the model runs, not how it is stored: not saved
            (a kbit folder loads fused; ``kbit.fuse_projections(model, enabled=False)`` turns it off).
        fp_targets, block_tune_steps: the two refinements of ``method="gptq"`` (``kbit.quantize_model``'s: each
            layer fitted to the unquantized model's outputs; each block's codebooks and block scales tuned for N
            steps to the unquantized block's outputs); off by default. Saved in config.json, as ``method`` is.

    ``format_version`` is the version of the saved format; a folder from a newer kbit is refused with a message.
    """

    def __init__(self, bits: int = 4, skip=None, min_features: int = 128, codebook=None,
                 format_version: int = folder.FORMAT_VERSION, quant_method: str = QUANT_METHOD,
                 kbit_version: Optional[str] = None, rotate: bool = False, method: str = "rtn", calibration=None,
                 tune_steps: int = 0, fuse_projections: bool = FUSE_BY_DEFAULT, fp_targets: bool = False,
                 block_tune_steps: int = 0):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"KbitConfig is for quant_method={QUANT_METHOD!r}, got {quant_method!r}")
        format_version = check_int(format_version, "format_version", 1)
        if format_version > folder.FORMAT_VERSION:
            raise ValueError(f"this kbit folder has format_version {format_version}, written by kbit {kbit_version}; "
                             f"kbit {__version__} reads up to {folder.FORMAT_VERSION}: upgrade kbit")
        self.quant_method = QUANT_METHOD
        self.bits = check_bits_setting(bits)
        self.skip = None if skip is None else check_skip(skip)
        self.min_features = check_int(min_features, "min_features", 0)
        if codebook is not None and not isinstance(self.bits, int):
            raise ValueError("a custom codebook is for one K: pass an int bits with it")
        self.codebook = None if codebook is None else codebook_values(codebook, self.bits)
        if not isinstance(rotate, bool):
            raise TypeError(f"rotate must be a bool, got {type(rotate).__name__}")
        self.rotate = rotate
        self.method = check_method(method)
        self.tune_steps = check_tune_steps(tune_steps)
        self.fp_targets, self.block_tune_steps = check_gptq_refinements(self.method, fp_targets, block_tune_steps)
        if calibration is not None:
            check_calibration_used(calibration, self.method, self.bits, self.tune_steps)
            if not is_text(calibration):  # text is tokenized once the model (and its tokenizer) is there
                check_calibration(calibration)
        self.calibration = calibration
        if not isinstance(fuse_projections, bool):
            raise TypeError(f"fuse_projections must be a bool, got {type(fuse_projections).__name__}")
        self.fuse_projections = fuse_projections
        self.format_version = format_version
        self.kbit_version = kbit_version or __version__

    def codebook_tensor(self) -> Optional[torch.Tensor]:
        return None if self.codebook is None else torch.tensor(self.codebook, dtype=torch.float32)

    def to_dict(self) -> dict:  # config.json: the stored format's settings, not the calibration data or how it runs
        return {key: value for key, value in super().to_dict().items() if key not in RUNTIME_SETTINGS}

    def to_diff_dict(self) -> dict:  # every field: early transformers 5.x have no default for this
        return self.to_dict()


def default_skip(model: torch.nn.Module) -> list:
    """What ``KbitConfig(skip=None)`` keeps in full precision (see ``KbitConfig``)."""
    names = {"lm_head"}
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if output is not None:
        names.update(name for name, m in model.named_modules() if m is output and name)
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        names.update(getattr(model, attr, None) or ())
    return sorted(n for n in names if n)


class KbitHfQuantizer(HfQuantizer):
    """transformers' hooks for kbit (module docstring); built by ``from_pretrained`` from a ``KbitConfig``."""

    requires_calibration = False
    quantization_config: KbitConfig

    def __init__(self, quantization_config: KbitConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        # Quantizing while loading: the Linear layers to quantize, the fused experts modules to quantize (name -> the
        # model's module) and those with one projection quantized so far (name -> (KbitExperts, projections done)).
        self._targets = frozenset()
        self.experts = {}
        self.experts_pending = {}
        self._saved_names = []  # loading a kbit folder: its KbitLinear layers' names
        self.progress = Progress(0, "", enabled=False)

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("kbit layers cannot be offloaded to disk: give device_map only cpu and cuda devices")

    @property
    def quantized_while_loading(self) -> bool:
        """rtn at one K quantizes each weight as it is read; the other methods, per-layer K (which needs every
        layer's sensitivity) and tuning (which needs the unquantized model's outputs) quantize the loaded model."""
        config = self.quantization_config
        return (not self.pre_quantized and config.method == "rtn" and isinstance(config.bits, int)
                and not config.tune_steps)

    @property
    def quantized_element_size(self) -> float:  # transformers' memory planning for weights quantized on load
        bits = self.quantization_config.bits
        return (max(bits.values()) if isinstance(bits, dict) else bits) / 8

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if self.pre_quantized:
            layers, experts = folder.checkpoint_modules(checkpoint_files, folder.model_renamings(model))
            folder.swap_in_kbit_layers(model, layers)
            folder.swap_in_kbit_experts(model, experts)
            self._saved_names = sorted(layers)
            # Grouped now, on meta: transformers prepares each layer as its tensors arrive, and the layer then moves
            # its layout into its group's stack, so no group is ever held twice (grouped after, it would be).
            fuse_projections(model, self.quantization_config.fuse_projections)
            return
        if not self.quantized_while_loading:
            return
        config = self.quantization_config
        skip = default_skip(model) if config.skip is None else config.skip
        targets, _, _ = linear_targets(model, skip, config.min_features)
        experts, _, _, unsupported = experts_targets(model, skip, config.min_features)
        for name, why in unsupported:
            warnings.warn(f"kbit: {name}: {why}; its experts stay in full precision", UserWarning, stacklevel=2)
        self._targets = frozenset(name for name, _ in targets)
        self.experts = dict(experts)
        # transformers draws its own loading bar; kbit's count goes to its logger (python -m kbit shows it in logs).
        total = len(self._targets) + len(FUSED_PARAMETERS) * len(self.experts)
        self.progress = Progress(total, "kbit: quantized while loading", bar=False, log=logger.info)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if not self.quantized_while_loading:
            return False
        module_name, _, tensor_name = param_name.rpartition(".")
        if tensor_name == "weight":
            return module_name in self._targets
        return tensor_name in FUSED_PARAMETERS and module_name in self.experts

    def update_parallel_plan(self, model, plan):  # tp_plan: kbit layers take kbit's styles (kbit.hf.tensor_parallel)
        from .tensor_parallel import kbit_plan

        super().update_parallel_plan(model, plan)
        kbit_plan(model, plan, self._targets | frozenset(self.experts))

    def get_quantize_ops(self):
        from .quantize_op import QuantizeWhileLoading

        return QuantizeWhileLoading(self)

    def get_weight_conversions(self):
        return [folder.packed_renaming(self._saved_names)] if self._saved_names else []

    def _process_model_after_weight_loading(self, model, **kwargs):
        from .tensor_parallel import finish_loading

        finish_loading(model)  # under a tp_plan: this rank's sharded layers; in any case the plan's own style names
        # A kbit folder's layers hold the storage format as loaded: each is checked, then (on CUDA) replaced by its
        # GEMM layout, one layer at a time (load_state_dict). Layers quantized during the load hold their layout
        # already; transformers re-creates non-persistent buffers empty once it has loaded, which is why the layout
        # buffers are persistent ones that state_dict leaves out (kbit.nn). prepare() makes sure of both.
        if self.pre_quantized:
            folder.check_loaded_layers(model)
        config = self.quantization_config
        fuse = config.fuse_projections
        if not self.pre_quantized:  # a kbit folder's layers were grouped before loading
            fuse_projections(model, fuse)  # first: each layer's layout then moves into its group's stack as it is made
        for module in model.modules():
            if isinstance(module, (KbitLinear, KbitExperts)):
                module.prepare()
        if self.pre_quantized:
            return model
        if not self.quantized_while_loading:  # the whole model is loaded: quantize it block by block
            if _sharded_by_a_tp_plan(model):
                raise ValueError(f"kbit quantizes with method={config.method!r}, per-layer bits or tuning on one "
                                 f"process (it runs the whole model to calibrate): quantize there, save the kbit "
                                 f"folder, and load that with tp_plan='auto' (method='rtn' at one bit width also "
                                 f"quantizes while loading under a tp_plan)")
            quantize_model(model, config.bits, config.codebook_tensor(),
                           default_skip(model) if config.skip is None else config.skip, config.min_features,
                           method=config.method, calibration=config.calibration, rotate=config.rotate,
                           tune_steps=config.tune_steps, fuse_projections=fuse, fp_targets=config.fp_targets,
                           block_tune_steps=config.block_tune_steps)
            return model
        incomplete = [f"{name}.{missing}" for name, (_, loaded) in self.experts_pending.items()
                      for missing in FUSED_PARAMETERS if missing not in loaded]
        if incomplete:
            raise ValueError(f"the checkpoint lacks {', '.join(incomplete)}")
        layers = sum(isinstance(m, (KbitLinear, KbitExperts)) for m in model.modules())
        summary = (f"kbit: {100 * quantized_fraction(model):.1f}% of {type(model).__name__}'s weights quantized to "
                   f"{config.bits} bits ({layers} layers)")
        logger.info(summary)
        return model

    def _dequantize(self, model, dtype=None):  # model.dequantize(): kbit layers back to full precision
        from .dequantize import dequantize_model

        return dequantize_model(model, dtype)

    def get_state_dict_and_metadata(self, model, *args, **kwargs):
        return folder.saved_state_dict(model), {}

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:  # adapters (PEFT LoRA, kbit.lora) train through kbit.matmul
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def _sharded_by_a_tp_plan(model) -> bool:
    """Whether transformers' tp_plan made any of ``model``'s parameters a DTensor (a full-precision layer's
    shard)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def register() -> None:
    """Make ``quant_method="kbit"`` known to transformers (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(KbitConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(KbitHfQuantizer)


def checked_config(**settings) -> KbitConfig:
    """A ``KbitConfig`` of settings in the form ``KbitConfig`` keeps them, checked already (``kbit.quantize_model``'s),
    not checked again; every other setting at ``KbitConfig``'s default."""
    defaults = {name: p.default for name, p in inspect.signature(KbitConfig).parameters.items()}
    config = KbitConfig.__new__(KbitConfig)
    vars(config).update(defaults, kbit_version=__version__, **settings)
    return config


def record_quantization(model, bits: int, skip, min_features: int, codebook=None, rotate: bool = False,
                        method: str = "rtn", tune_steps: int = 0, fp_targets: bool = False,
                        block_tune_steps: int = 0) -> None:
    """Mark a transformers model quantized by ``kbit.quantize_model`` as kbit-quantized, as ``from_pretrained``
    would have: ``save_pretrained`` then writes ``quantization_config`` (how the weights were made included) and
    the kbit weight names."""
    if isinstance(getattr(model, "hf_quantizer", None), KbitHfQuantizer):
        return  # loaded through kbit's quantizer: its config describes the model
    config = checked_config(bits=bits, skip=skip, min_features=min_features,
                            codebook=None if codebook is None else codebook.tolist(), rotate=rotate, method=method,
                            tune_steps=tune_steps, fp_targets=fp_targets, block_tune_steps=block_tune_steps)
    model.config.quantization_config = config
    model.hf_quantizer = KbitHfQuantizer(config, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD


register()
