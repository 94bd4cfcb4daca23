"""``KbitLinear`` (a drop-in ``nn.Linear`` replacement) and ``quantize_model``.

    layer = kbit.KbitLinear.from_linear(linear, bits=4)
    model = kbit.quantize_model(model, bits=4)          # swaps eligible nn.Linear layers in place

A ``KbitLinear`` holds the storage format of its weight as buffers named like the keys of
``QuantizedWeight.state_dict()`` (``packed``, ``absmax``, ``codebook``, ``scale``, ``meta``) plus
an optional ``bias`` parameter, so it saves and loads through ``state_dict`` (``torch.save`` or
safetensors) and loads into a module built from its shape alone (its other parameter, ``weight_count``, holds
nothing and is never saved: it makes parameter counts see the weight, ``kbit._counted``)::

    fresh = kbit.KbitLinear(in_features, out_features, bias=True, bits=4)
    fresh.load_state_dict(state)

Dtype casts (``.half()``, ``.to(torch.bfloat16)``) move the bias but never touch the quantized
buffers; device moves move everything. The module keeps one ``QuantizedWeight`` view of its
buffers; the view is rebuilt whenever the buffers change (device moves, ``load_state_dict``, or
assigning a new buffer).

One resident copy of the codes. On a CUDA device the module holds the weight's GEMM layout
(``kbit.layout``: buffers ``gemm_codes`` and ``gemm_absmax``) in place of ``packed`` and ``absmax``
(then None), with ``codebook``, ``scale``, ``meta`` and the rotation: the layout is derived and the
storage format dropped as soon as the module lands there (``.to("cuda")``, ``load_state_dict``,
``from_quantized``, ``kbit.prepare(model)``), one layer at a time, and its buffers are marked as static
addresses for ``torch.compile``: nothing is derived or allocated inside a compiled or captured region
(the dequantize + cuBLAS path of long prompts derives the storage format of the layer it multiplies, a
temporary like the dequantized weight itself). What is saved is still the storage format:
``state_dict`` (so ``save_pretrained``), ``.to("cpu")`` and ``dequantize`` derive it from the layout
(``kbit.ops.unrepack``), bit for bit the one the layer was built from. Elsewhere (CPU, meta) the module
holds the storage format alone. The layout buffers are registered persistent, so that loaders that
re-create non-persistent buffers empty (transformers' ``from_pretrained`` does) leave them alone, but
``state_dict`` never holds them.

A checkpoint is untrusted input: ``load_state_dict`` checks every tensor's dtype, shape and values
(``kbit._validate``) before anything reaches a kernel.
"""

from __future__ import annotations

import fnmatch
import logging
import warnings
from functools import partial
from typing import Iterable, Optional, Union

import torch
from torch import Tensor, nn

from . import ops, planner
from ._counted import count_name, hold_count
from ._kbit_module import KbitModule
from ._layers import linear_features, linear_weight
from ._progress import Progress
from ._validate import (
    GEMM_DTYPES,
    INPUT_DTYPES,
    SUPPORTED_BITS,
    check_bits,
    check_codebook,
    check_dtype,
    check_int,
    check_meta,
    check_range,
    check_scale,
    check_skip,
    check_storage_tensor,
    check_weight,
)
from .bit_budget import check_bits_setting, choose_layer_bits
from .calibration import (check_calibration, check_calibration_used, check_gptq_refinements, quantize_layers,
                          uses_calibration)
from .calibration_text import default_calibration, is_text
from .dequantized_weight import DequantizedWeight
from .finetune import check_tune_steps, reference_outputs, tune_block, tune_end_to_end, tuning_batches
from .formats import STATE_KEYS, create_normal_float_codebook, meta_tensor, padded_in_features, storage_spec
from .fusion import FUSE_BY_DEFAULT, FusedProjections, groups_of, why_separate
from .methods import GPTQ_DAMP, check_method
from .moe import KbitExperts, experts_shape, find_experts, precision_losses, unsupported_reason
from .rotation import Rotation, check_rotation, hadamard, rotate
from .weight import (PrecisionWarning, QuantizedWeight, matmul, matmul_unchecked, quantize, quantize_checked,
                     warn_precision)

__all__ = ["KbitLinear", "quantize_model", "prepare", "quantized_fraction", "fuse_projections"]

logger = logging.getLogger("kbit")

GEMM_LAYOUT = ("gemm_codes", "gemm_absmax")  # KbitLinear's buffers of the GEMM layout (module docstring)
WEIGHT_COUNT = count_name("weight")  # the empty parameter that counts the weight's elements (kbit._counted)
# Called as hook(model, **settings) once quantize_model is done. kbit.hf, drawn above this module, adds the one that
# records the settings on a transformers model (kbit.hf.hook.install), so that this module need not import it.
QUANTIZED_HOOKS: list = []


class KbitLinear(KbitModule, nn.Linear):
    """``y = x @ W_hat.T + bias`` with ``W_hat`` stored quantized to ``bits`` bits per weight (``kbit.matmul``).

    It subclasses ``nn.Linear`` (as bitsandbytes' quantized layers do) so that code which picks layers by type treats
    it as one: PEFT's LoRA wraps it with its own ``lora.Linear`` (``get_peft_model``, ``target_modules="all-linear"``),
    with no kbit-specific step. It shares none of ``nn.Linear``'s state: ``weight`` is a read-only view of the
    quantized storage (``DequantizedWeight``), not a parameter; PEFT's parameter counts see it through the empty
    ``weight_count`` parameter (``kbit._counted``).

    Args:
        in_features, out_features: the shape of the original ``nn.Linear``.
        bias: whether the layer has a bias (a ``Parameter`` of ``dtype``).
        bits: bits per weight, 2..5.
        dtype: dtype of the original weight (what ``dequantize`` returns by default) and of the bias.
        device: where the buffers live.
        codebook: optional custom codebook (2**bits sorted values in [-1, 1]); default normal-float.
        rotation_block: 0 (default) for a weight stored as is; else the stored weight is ``W @ R``, rotated on
            its input features (``kbit.rotation``: random signs, then Hadamard blocks of this size), and the
            module rotates its input before the k-bit matmul. Its two extra buffers, ``rotation_signs`` (int8
            [in_features]) and ``rotation_block`` (int64), are saved with the layer.

    A module built this way holds an all-zero weight: fill it with ``load_state_dict`` or build
    it with ``from_linear`` / ``from_quantized``.
    """

    # KbitModule's names: the storage format (its codes derived from the GEMM layout when GEMM-resident), the
    # buffers of the one weight, the counting parameter, the full-precision weight that is held quantized.
    FORMAT_KEYS, COUNTS, REFUSED = STATE_KEYS, (WEIGHT_COUNT,), ("weight",)
    WEIGHTS = {"weight": ("packed", "absmax", "scale", *GEMM_LAYOUT)}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits: int = 4,
        dtype: torch.dtype = torch.float16,
        device=None,
        codebook: Optional[Tensor] = None,
        rotation_block: int = 0,
    ):
        bits = check_bits(bits)
        in_features, out_features = check_int(in_features, "in_features", 1), check_int(out_features, "out_features", 1)
        check_dtype(dtype, "dtype")
        cb = create_normal_float_codebook(bits) if codebook is None else check_codebook(codebook, bits)
        rotation_block = check_int(rotation_block, "rotation_block", 0)
        if rotation_block:
            check_rotation(torch.ones(in_features, dtype=torch.int8), rotation_block, in_features)
        self._build(in_features, out_features, bias, bits, dtype, device, cb, rotation_block)

    @classmethod
    def from_checked(cls, in_features: int, out_features: int, bias: bool, bits: int, dtype: torch.dtype, device=None,
                     codebook: Optional[Tensor] = None, rotation_block: int = 0) -> "KbitLinear":
        """The constructor without its checks, for arguments checked already (a checkpoint's checked ``meta``)."""
        mod = cls.__new__(cls)
        cb = create_normal_float_codebook(bits) if codebook is None else codebook
        mod._build(in_features, out_features, bias, bits, dtype, device, cb, rotation_block)
        return mod

    def _build(self, in_features: int, out_features: int, bias: bool, bits: int, dtype: torch.dtype, device,
               codebook: Tensor, rotation_block: int = 0) -> None:
        """The module's state: all-zero storage of a checked shape, bits, dtype, codebook and rotation block."""
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a full-precision weight
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.weight_dtype = dtype
        shape = (out_features, in_features)
        for key in ("packed", "absmax"):
            dtype_of, shape_of = storage_spec(key, bits, shape)
            self.register_buffer(key, torch.zeros(shape_of, dtype=dtype_of, device=device))
        self.register_buffer("codebook", codebook.to(device=device, dtype=torch.float32))
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("meta", self._meta_tensor(device))
        if rotation_block:
            self.register_buffer("rotation_signs", torch.ones(in_features, dtype=torch.int8, device=device))
            self.register_buffer("rotation_block", torch.tensor(rotation_block, dtype=torch.int64, device=device))
        else:
            self.register_buffer("rotation_signs", None)
            self.register_buffer("rotation_block", None)
        self._block = rotation_block  # the block as a Python int: reading the buffer in forward would sync
        for name in GEMM_LAYOUT:  # set on CUDA only, in place of packed and absmax (module docstring)
            self.register_buffer(name, None)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self._invalidate()
        self._direct = None  # (qweight, bias, kernel) of _direct_cpu_kernel
        self._fusion: Optional[FusedProjections] = None  # the sibling projections it shares GEMM launches with
        self._fusion_slot = 0  # its place among them
        self.prepare()

    # ------------------------------------------------------------------ construction
    def _meta_tensor(self, device=None) -> Tensor:
        return meta_tensor(self.bits, (self.out_features, self.in_features), self.weight_dtype, device)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: Optional[Tensor] = None,
                       rotation: Optional[Rotation] = None) -> "KbitLinear":
        """Wrap an existing ``QuantizedWeight`` (its tensors are shared, not copied; on a CUDA device the module
        keeps its GEMM layout, cached or derived now, and not its storage format). ``rotation``: the
        ``kbit.rotation.Rotation`` whose rotated weight ``qw`` holds, None for an unrotated one."""
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"qw must be a kbit.QuantizedWeight, got {type(qw).__name__}")
        out_features, in_features = qw.shape
        if bias is not None:
            if not isinstance(bias, Tensor):
                raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
            if tuple(bias.shape) != (out_features,):
                raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        if rotation is not None:
            check_rotation(rotation.signs, rotation.block, in_features)
        return cls._wrap(qw, bias, rotation)

    @classmethod
    def _wrap(cls, qw: QuantizedWeight, bias: Optional[Tensor], rotation: Optional[Rotation] = None) -> "KbitLinear":
        """``from_quantized`` for a bias (and rotation) already checked against ``qw``."""
        out_features, in_features = qw.shape
        block = 0 if rotation is None else rotation.block
        mod = cls.from_checked(in_features, out_features, bias is not None, qw.bits, qw.dtype, "meta", qw.codebook,
                               block)
        if qw.is_gemm_resident and qw.device.type == "cuda":
            mod.packed = mod.absmax = None
            mod.gemm_codes, mod.gemm_absmax = qw.gemm_layout()
        else:
            mod.packed, mod.absmax = qw.storage()
        mod.codebook, mod.scale = qw.codebook, qw.scale
        mod.meta = mod._meta_tensor(qw.device)
        if rotation is not None:
            mod.rotation_signs = rotation.signs.to(device=qw.device, dtype=torch.int8).contiguous()
            mod.rotation_block = torch.tensor(rotation.block, dtype=torch.int64, device=qw.device)
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        mod._views["weight"] = qw
        return mod.prepare()

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, codebook: Optional[Tensor] = None) -> "KbitLinear":
        """Quantize an ``nn.Linear`` (on its own device) into a new ``KbitLinear``."""
        if not isinstance(linear, nn.Linear) or isinstance(linear, KbitLinear):
            raise TypeError(f"linear must be an nn.Linear (not already a KbitLinear), got {type(linear).__name__}")
        w = linear.weight
        if w.device.type == "meta":
            raise ValueError("cannot quantize a Linear whose weight is on the meta device (it holds no values); "
                             "load its weights first")
        with torch.no_grad():
            qw = quantize(w.detach(), bits=bits, codebook=codebook, name="linear.weight")
        return cls.from_quantized(qw, linear.bias)

    # ------------------------------------------------------------------ the QuantizedWeight view
    @property
    def is_gemm_resident(self) -> bool:
        """Whether the module holds the GEMM layout in place of the storage format (on CUDA; module docstring)."""
        return self._held("packed") is None

    @property
    def qweight(self) -> QuantizedWeight:
        """A ``QuantizedWeight`` view of the held tensors, GEMM-resident when the module is (kept while they stay
        the same, so a GEMM layout derived from the storage format stays cached: ``KbitModule._view``)."""
        return self._view("weight")

    def _weight_shape(self, name: str) -> tuple:
        return (self.out_features, self.in_features), None

    def prepare(self) -> "KbitLinear":
        """On a CUDA device: hold the GEMM layout (derived from the storage format, which is then dropped), as
        buffers marked static for ``torch.compile``. Does nothing elsewhere. Returns self.

        Called when the module is built, moves to CUDA or loads a state dict there; call it yourself (or
        ``kbit.prepare(model)``) after assigning ``packed`` or ``absmax`` by hand.
        """
        device = self.codebook.device
        self._hold_counts()
        if device.type == "cuda":
            self._hold_layout()
            self.qweight.prepare()
            if self._block:  # the Hadamard matrices forward uses, made now rather than inside a captured region
                for dtype in GEMM_DTYPES:
                    hadamard(self._block, dtype, device)
        if self._fusion is not None:  # its siblings' stacked layout takes its rows back (kbit.fusion)
            self._fusion.refresh()
        return self

    def _hold_counts(self) -> None:
        hold_count(self, WEIGHT_COUNT, self.out_features * self.in_features, self.weight_dtype, self.codebook.device)

    @property
    def rotation(self) -> Optional[Rotation]:
        """The input rotation of the stored weight, None for an unrotated one."""
        return None if self.rotation_signs is None else Rotation(self.rotation_signs, self._block)

    def dequantize(self, dtype=None) -> Tensor:
        """The [out_features, in_features] reconstructed weight in the original basis (default: the original
        dtype): a rotated layer's stored weight is un-rotated."""
        return DequantizedWeight(self.qweight, self.rotation).dequantize(dtype)

    @property
    def weight(self) -> DequantizedWeight:
        """The weight as a read-only tensor: the original shape, dtype and device, free to read; an operation on
        it (``F.linear(x, layer.weight)``) dequantizes (and un-rotates) for that operation only. Not a parameter
        or buffer, so ``state_dict`` holds only the quantized storage; parameter counts see the weight through
        ``weight_count`` (``kbit._counted``)."""
        return DequantizedWeight(self.qweight, self.rotation)

    def reset_parameters(self) -> None:  # nn.Linear's would write random values into the read-only weight
        raise TypeError("a KbitLinear's weight is stored quantized and cannot be re-initialized")

    def forward(self, x: Tensor) -> Tensor:
        if self._fusion is not None:  # one launch for this layer and its siblings (kbit.fusion)
            y = self._fusion.output(self, self._fusion_slot, x)
            if y is not None:
                return y
        return self._product(x, self._parameters["bias"])

    def _product(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        """``x`` (rotated where the weight is) times the weight, plus ``bias`` (this layer's, or None where a sharded
        layer adds it after a sum): from the held layout, or the CPU kernel, or kbit.matmul."""
        y = self._layout_product(x, bias)
        if y is not None:
            return y
        rotation = self.rotation
        if rotation is not None:
            x = rotation.rotate(x)
        kernel = self._direct_cpu_kernel(x, bias)
        if kernel is not None:
            return kernel(x.reshape(-1, self.in_features), bias).view(*x.shape[:-1], self.out_features)
        qw = self.qweight
        if (isinstance(x, Tensor) and x.dim() and x.shape[-1] == self.in_features and x.dtype in INPUT_DTYPES
                and x.device == qw.device and (bias is None or bias.shape == (self.out_features,)
                                               and bias.device == x.device)):
            return matmul_unchecked(x, qw, bias)  # the weight is this layer's own, checked when it was set
        return matmul(x, qw, bias)  # which says what is wrong

    def _layout_assigned(self) -> None:
        fusion = self.__dict__.get("_fusion")
        if fusion is not None:  # its siblings' launch reads the stack, not this buffer (kbit.fusion)
            fusion.member_assigned()

    def _layout_product(self, x: Tensor, bias: Optional[Tensor]) -> Optional[Tensor]:
        """The product (plus ``bias``) of a GEMM-resident layer (on CUDA; on CPU where made so by hand), from its
        buffers read once from the module's dicts and no other state: kbit.matmul's result from the same op and
        tensors. An eager call pays host time for each step of the general path (the QuantizedWeight view, its
        checks), and a compiled graph checks a guard for every object its trace read, at every call: through the
        view, the tensors twice and the view's attributes. None where the general path decides (and says what is
        wrong): no layout held, x of another type, dtype, device or width, a plan of dequantize + cuBLAS."""
        buffers = self._buffers
        codes = buffers["gemm_codes"]
        if (codes is None or type(x) is not Tensor or x.dtype not in GEMM_DTYPES or x.device != codes.device
                or x.dim() == 0 or x.shape[-1] != self.in_features):
            return None
        K = padded_in_features(self.in_features)
        x2 = x.reshape(-1, self.in_features)
        tokens = x2.shape[0]
        if x.device.type == "cuda" and planner.dequantizes_first(x.device, self.out_features, K, tokens, self.bits):
            return None
        signs = buffers["rotation_signs"]
        if signs is not None:
            x2 = rotate(x2, signs, self._block)
        y = ops.gemm_direct(x2, codes, buffers["gemm_absmax"], buffers["codebook"], buffers["scale"],
                            None if bias is None else bias.to(x.dtype).contiguous(), self.bits, self.out_features, K, 0)
        return y.view(*x.shape[:-1], self.out_features)

    def _direct_cpu_kernel(self, x: Tensor, bias: Optional[Tensor]):
        """The CPU kernel bound to this layer's weight and ``bias``, for a call that needs neither autograd nor
        torch.compile's tracing: the ``kbit::matmul_stored`` op and ``kbit.matmul``'s checks cost more Python per
        call than a small layer's GEMM at one token. None otherwise (then ``kbit.matmul`` checks x and runs the
        op). Bound once, checked then by the op's contract, again when the weight (``qweight``) or bias changes."""
        if (type(x) is not Tensor or x.device.type != "cpu" or x.dtype not in INPUT_DTYPES or x.dim() == 0
                or self.is_gemm_resident and x.dtype in GEMM_DTYPES  # kbit.matmul multiplies from the layout
                or x.shape[-1] != self.in_features or torch.compiler.is_compiling()
                or torch.is_grad_enabled() and (x.requires_grad or bias is not None and bias.requires_grad)):
            return None
        qw = self.qweight
        bound = self._direct
        if bound is None or bound[0] is not qw or bound[1] is not bias:
            kernel = qw._stored_cpu_kernel(x.reshape(-1, self.in_features), bias)
            self._direct = bound = (qw, bias, kernel)
        return bound[2]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"bits={self.bits}, dtype={str(self.weight_dtype).replace('torch.', '')}"
            + (f", rotation_block={self._block}" if self._block else "")
        )

    # ------------------------------------------------------------------ moving, saving, loading (KbitModule)
    def _moved(self) -> None:
        self._hold_counts()
        if self.codebook.device.type != "meta":
            self.prepare()

    def _check_state(self, state_dict, prefix: str) -> torch.dtype:
        meta = state_dict.get(prefix + "meta")
        dtype = self.weight_dtype
        if isinstance(meta, Tensor) and meta.device.type != "meta":
            bits, shape, dtype = check_meta(meta, prefix + "meta")
            if (bits, shape) != (self.bits, (self.out_features, self.in_features)):
                raise ValueError(
                    f"{prefix}meta describes a bits={bits} {list(shape)} weight, but this KbitLinear is "
                    f"bits={self.bits} [{self.out_features}, {self.in_features}]; build it with the checkpoint's "
                    f"shape and bits"
                )
        for name in ("codebook", "scale"):  # float32 by definition; a checkpoint cast to 16 bits still loads
            t = state_dict.get(prefix + name)
            if isinstance(t, Tensor) and t.dtype != torch.float32 and t.is_floating_point():
                state_dict[prefix + name] = t.to(torch.float32)
        self._check_incoming(state_dict, prefix, dtype)
        return dtype

    def _loaded(self, state_dict, prefix: str) -> None:
        block = state_dict.get(prefix + "rotation_block")
        if self.rotation_block is not None and isinstance(block, Tensor) and block.device.type != "meta":
            self._block = int(block)

    def _check_incoming(self, state_dict, prefix: str, dtype: torch.dtype) -> None:
        """Dtype, shape and values of each storage tensor a state dict brings (missing ones keep the module's), and
        their range against the weight's ``dtype``."""
        shape = (self.out_features, self.in_features)
        for key in ("packed", "absmax", "codebook", "scale"):
            t = state_dict.get(prefix + key)
            if t is None:
                continue
            check_storage_tensor(t, key, self.bits, shape, prefix)
            if t.device.type == "meta":
                continue
            if key == "codebook":
                check_codebook(t, self.bits, prefix + key)
            elif key == "scale":
                check_scale(t, t.device, prefix + key)
        absmax = state_dict.get(prefix + "absmax")
        if absmax is None:  # the module's own block scales: held, or derived from the GEMM layout
            absmax = self.absmax if self.absmax is not None else self.qweight.absmax
        scale, codebook = (state_dict.get(prefix + key, self._buffers[key]) for key in ("scale", "codebook"))
        if all(t.device.type != "meta" for t in (absmax, scale, codebook)):
            check_range(absmax, scale, codebook, dtype, f"{prefix}absmax with {prefix}scale")
        if self.rotation_signs is None:
            return  # rotation entries in the state dict are unexpected keys: load_state_dict reports them
        signs, block = state_dict.get(prefix + "rotation_signs"), state_dict.get(prefix + "rotation_block")
        if signs is None and block is None:
            return
        if signs is None or block is None:
            raise ValueError(f"{prefix}rotation_signs and {prefix}rotation_block come together; got only one")
        if signs.device.type != "meta" and block.device.type != "meta":
            check_rotation(signs, block, self.in_features, prefix)

    def __getstate__(self):  # the bound kernel holds its own references to the tensors: a copy binds its own
        return {**super().__getstate__(), "_direct": None}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_fusion", None)  # pickled before fusion existed
        self.__dict__.setdefault("_fusion_slot", 0)


# ---------------------------------------------------------------------- model conversion
def _matches(name: str, patterns: Iterable[str]) -> bool:
    for p in patterns:
        if name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p):
            return True
    return False


def tied_weights(model: nn.Module) -> dict:
    """``{module name: (its tied parameter, the parameter it is tied to)}``: ties transformers declares
    (``all_tied_weights_keys``: ``lm_head`` to the input embeddings, a masked-LM decoder to the word embeddings) and
    one parameter held by two modules. Quantizing such a module would break the tie, and a transformers checkpoint
    saved so would not load."""
    names_of = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(m), []).append(name)
    ties = {}

    def tie(key: str, partner: str) -> None:
        module_name = key.rpartition(".")[0]
        try:
            module = model.get_submodule(module_name)
        except AttributeError:  # a declared key this model does not have
            return
        for name in names_of.get(id(module), [module_name]):
            ties.setdefault(name, (key, partner))

    for key, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        tie(key, source)
        tie(source, key)
    holders = {}
    for name, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    for keys in holders.values():
        for i, key in enumerate(keys if len(keys) > 1 else ()):
            tie(key, keys[1 if i == 0 else 0])
    return ties


def linear_targets(model: nn.Module, skip: Iterable[str], min_features: int):
    """The layers ``quantize_model`` swaps, as ``([(name, layer)], skipped, small)``.

    A layer is an ``nn.Linear`` or a transformers ``Conv1D`` (GPT-2 family) whose name does not match ``skip``, that
    is not inside an ``nn.MultiheadAttention`` (which reads its projection's weight directly), whose weight is not
    tied to another module's (``tied_weights``) and whose ``min(in_features, out_features)`` is at least
    ``min_features``; ``skipped`` and ``small`` count the others.
    """
    tied = tied_weights(model)
    mha_children = set()
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            mha_children.update(id(c) for c in m.children())
    targets, skipped, small = [], 0, 0
    for name, m in model.named_modules(remove_duplicate=False):
        features = linear_features(m)
        if features is None or isinstance(m, KbitLinear):  # a KbitLinear is an nn.Linear, already quantized
            continue
        if id(m) in mha_children or name in tied or _matches(name, skip):
            skipped += 1
        elif min(features) < min_features:
            small += 1
        else:
            targets.append((name, m))
    return targets, skipped, small


def experts_targets(model: nn.Module, skip: Iterable[str], min_features: int):
    """The fused experts modules ``quantize_model`` replaces, as ``([(name, module)], skipped, small, unsupported)``.

    ``skip`` applies to the experts module's name and ``min_features`` to min(H, I); ``unsupported`` lists
    ``(name, why)`` for the fused experts modules ``KbitExperts`` cannot compute (``kbit.moe.unsupported_reason``).
    """
    targets, skipped, small, unsupported = [], 0, 0, []
    for name, m in find_experts(model):
        why = unsupported_reason(m)
        if _matches(name, skip):
            skipped += 1
        elif why:
            unsupported.append((name, why))
        elif min(experts_shape(m)[1:]) < min_features:
            small += 1
        else:
            targets.append((name, m))
    return targets, skipped, small, unsupported


def quantize_model(
    model: nn.Module,
    bits: int = 4,
    codebook: Optional[Tensor] = None,
    skip: Union[str, Iterable[str]] = ("lm_head",),
    min_features: int = 128,
    progress: bool = True,
    method: str = "rtn",
    calibration=None,
    rotate: bool = False,
    tokenizer=None,
    tune_steps: int = 0,
    fuse_projections: bool = FUSE_BY_DEFAULT,
    fp_targets: bool = False,
    block_tune_steps: int = 0,
) -> nn.Module:
    """Replace every eligible ``nn.Linear`` of ``model`` with a ``KbitLinear``, in place.

    ``method`` chooses how each weight's codebook, block scales and codes are picked (``kbit.methods``): ``"rtn"``
    (normal-float codebook, absmax block scales, nearest codes), ``"mse"`` (data-free: a codebook fitted per
    tensor and block scales that minimize each block's error) or ``"gptq"`` (calibrated: error-compensating codes
    from each layer's input Hessian; needs ``calibration``, token ids [n_seq, seq_len] or a list of dicts of model
    inputs, run block by block, on the GPU when there is one). All three give the same storage format and speed.
    Fused MoE experts are quantized with ``"rtn"`` whatever the method.

    ``bits``: an int K for every layer; a float, a budget in average bits per weight (block scales counted, 2.25
    .. 5.25), K chosen per layer (2..5) to minimise the estimated loss increase (``kbit.bit_budget``); or a dict
    ``{name or pattern: K}`` matched against each layer's name as ``skip`` is (first key that matches). Without
    ``calibration``, ``method="gptq"`` and a budget use kbit's built-in calibration text
    (``kbit.calibration_text``), tokenized with ``tokenizer`` (default: the transformers tokenizer saved with
    the model, from ``model.config._name_or_path``). ``calibration`` may also be text (a str): tokenized the same
    way and mixed with the built-in text (``calibration_tokens``), which keeps narrow text (markdown and code,
    say) from fitting the layers to one kind of text; or a list of short texts (sentences, for a sentence
    encoder): padded batches with the built-in text's lines and sentences of random vocabulary words beside them
    (``calibration_batches``). Token ids and model inputs are used as given.

    ``tune_steps``: after quantizing, tune every ``KbitLinear``'s codebook and block scales end to end for this many
    Adam steps (``kbit.finetune``; 0, the default: no tuning), codes fixed, so that the model's next-token
    distributions (an encoder's outputs) on the calibration data match the unquantized model's; the result is the
    same storage format. Runs on the model's device; needs calibration as gptq does (the built-in text when none
    is given). Fused MoE experts are not tuned.

    Two refinements of ``method="gptq"`` for the layers inside a model's list of blocks, both off by default
    (``kbit.calibration``): ``fp_targets=True`` fits each layer to the unquantized model's outputs on the
    unquantized model's inputs rather than to its own weight on the inputs the quantized layers before it produce,
    so a layer also corrects the error the layers before it left (the unquantized model runs beside the quantized
    one: about twice the calibration passes); ``block_tune_steps=N`` tunes each block's codebooks and block scales
    for N Adam steps, once its layers are quantized, so that the block's outputs match the unquantized model's
    (``kbit.finetune.tune_block``) before the next block is calibrated on them.

    ``rotate``: quantize each layer's weight in a rotated basis of its input features (``kbit.rotation``: random
    signs, then a block-diagonal Hadamard transform), which spreads outlier weights over many inputs and lowers
    the error at K = 2..3; the layer rotates its activations before the same k-bit matmul (a small extra cost),
    and ``.weight`` / ``dequantize()`` are in the original basis. Layers whose ``in_features`` is odd stay
    unrotated; fused MoE experts are never rotated.

    transformers' ``Conv1D`` layers (GPT-2 family; weight stored [in, out]) count as Linear layers and become a
    ``KbitLinear`` of their transposed weight. A Linear is eligible unless its qualified name matches ``skip``
    (exact name, a name suffix after a dot such as ``"lm_head"`` for ``"model.lm_head"``, or an ``fnmatch``
    pattern such as ``"*.mlp.gate"``), or ``min(in_features, out_features) < min_features`` (tiny layers such as
    MoE routers are better left in full precision), or it is the output projection of an
    ``nn.MultiheadAttention`` (which reads its weight directly), or its weight is tied to another module's
    (``lm_head`` under ``tie_word_embeddings``, a masked-LM decoder): whatever ``skip`` says, quantizing a tied
    weight would break the tie. A Linear shared under several
    names becomes one shared ``KbitLinear``. Returns the model (or the new module if ``model``
    itself is an eligible Linear).

    Mixture-of-experts layers whose experts are fused 3-D parameters (transformers 5.x: ``experts.gate_up_proj``
    [E, 2I, H] and ``experts.down_proj``) become ``kbit.KbitExperts`` under the same rules (``skip`` by the experts
    module's name, ``min_features`` against H and I); a fused experts module kbit cannot compute (biases, no gate,
    its own gating) stays in full precision with a ``UserWarning`` naming it. The share of the model's weights
    now quantized (``quantized_fraction``) is logged to the ``"kbit"`` logger and, with ``progress``, printed after
    the progress bar (on a terminal; one line per tenth of the layers in a log).

    ``fuse_projections``: sibling projections that read the same input (q/k/v, gate/up) run as one GEMM launch
    where that is exact (``kbit.fuse_projections``; each layer keeps its own tensors and state dict).

    On a transformers model the settings are also recorded as ``model.config.quantization_config`` (a
    ``kbit.KbitConfig``), so ``save_pretrained`` writes a folder that ``from_pretrained`` loads back.

    Every layer is quantized before any is swapped: a layer that cannot be quantized (NaN weights, say)
    raises a ``ValueError`` naming it and leaves the model unchanged. A layer some of whose blocks lose
    more than the format's error bound gets a ``kbit.PrecisionWarning`` naming it and the count; a model
    with nothing eligible gets a ``UserWarning`` saying why.
    """
    bits = check_bits_setting(bits)
    uniform = isinstance(bits, int)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if codebook is not None:
        if not uniform:
            raise ValueError("a custom codebook is for one K: pass an int bits with it")
        codebook = check_codebook(codebook, bits)
    skip = tuple(check_skip(skip))
    min_features = check_int(min_features, "min_features", 0)
    method = check_method(method)
    tune_steps = check_tune_steps(tune_steps)
    calibrated = uses_calibration(method, bits, tune_steps)
    check_calibration_used(calibration, method, bits, tune_steps)
    if is_text(calibration):
        calibration = default_calibration(model, tokenizer, calibration)  # the user's text(s) and the built-in text
    elif calibration is not None:
        check_calibration(calibration)
    if not isinstance(rotate, bool):
        raise TypeError(f"rotate must be a bool, got {type(rotate).__name__}")
    fp_targets, block_tune_steps = check_gptq_refinements(method, fp_targets, block_tune_steps)
    if not isinstance(fuse_projections, bool):
        raise TypeError(f"fuse_projections must be a bool, got {type(fuse_projections).__name__}")

    targets, skipped, small = linear_targets(model, skip, min_features)
    expert_targets, experts_skipped, experts_small, unsupported = experts_targets(model, skip, min_features)
    skipped, small = skipped + experts_skipped, small + experts_small
    for name, why in unsupported:
        warnings.warn(f"quantize_model: {name}: {why}; its experts stay in full precision", UserWarning, stacklevel=2)
    if not targets and not expert_targets:
        warnings.warn(
            f"quantize_model: nothing to quantize in {type(model).__name__}: {skipped + small} nn.Linear or experts "
            f"layer(s), {skipped} skipped by name (skip={list(skip)}) or inside nn.MultiheadAttention, {small} "
            f"narrower than min_features={min_features}",
            UserWarning, stacklevel=2,
        )
        return model

    replaced = {}
    unique = list({id(m): (n, m) for n, m in reversed(targets)}.values())[::-1]
    rotations = {}
    if rotate:
        for name, lin in unique:
            rotation = Rotation.for_layer(name, linear_features(lin)[0])
            if rotation is not None:
                rotations[id(lin)] = rotation
    if not uniform and expert_targets:
        raise ValueError("quantize_model: per-layer bits do not cover fused MoE experts; pass an int bits")
    if calibrated and calibration is None and targets:
        calibration = default_calibration(model, tokenizer)
    if tune_steps and any(name == "" for name, _ in targets):
        raise ValueError("quantize_model: tune_steps tunes the layers inside a model; model is itself a Linear "
                         "(quantize it without tune_steps)")
    references = None
    if tune_steps and targets:  # the unquantized model's outputs, which tuning matches
        tune_on = tuning_batches(calibration)
        references = reference_outputs(model, tune_on)
    ks = bits
    if not uniform:
        try:
            ks = choose_layer_bits(model, unique, bits, check_calibration(calibration) if calibrated else None,
                                   linear_weight, rotations, gptq=method == "gptq", damp=GPTQ_DAMP)
        except (TypeError, ValueError) as e:
            raise ValueError(f"quantize_model: {e}; the model is unchanged") from e
    with torch.no_grad():
        bar = Progress(len(targets) + len(expert_targets), "kbit: quantizing", progress)
        chosen = {}
        if method != "rtn":  # kbit.calibration runs the method; the swap below is the same for every method
            try:
                chosen = quantize_layers(model, unique, ks, method, codebook, calibration, on_layer=bar.update,
                                         weight_of=linear_weight, rotations=rotations, fp_targets=fp_targets,
                                         block_tuner=partial(tune_block, steps=block_tune_steps) if block_tune_steps
                                         else None)
            except (TypeError, ValueError) as e:
                raise ValueError(f"quantize_model: {e}; the model is unchanged") from e
        for name, lin in targets:
            if id(lin) in chosen:
                replaced[id(lin)] = (chosen[id(lin)], lin.bias, rotations.get(id(lin)))
                continue
            bar.update()
            if id(lin) in replaced:
                continue
            label = f"{name or type(lin).__name__}.weight"
            w, rotation = linear_weight(lin).detach(), rotations.get(id(lin))
            if rotation is not None:
                w = rotation.rotate(w.float()).to(w.dtype)
            try:
                qw, loss = quantize_checked(check_weight(w, label), ks if uniform else ks[id(lin)], codebook)
            except (TypeError, ValueError) as e:
                raise ValueError(f"quantize_model: cannot quantize {name or 'the model'}: {e}; the model is unchanged") from e
            warn_precision(loss, label)
            replaced[id(lin)] = (qw, lin.bias, rotation)
        for name, m in expert_targets:
            bar.update()
            if id(m) in replaced:
                continue
            try:
                experts, losses = KbitExperts.from_experts_checked(m, bits, codebook, name)
            except (TypeError, ValueError) as e:
                raise ValueError(f"quantize_model: cannot quantize {name}: {e}; the model is unchanged") from e
            for label, loss in precision_losses(losses):
                warnings.warn(loss.describe(label), PrecisionWarning, stacklevel=2)
            replaced[id(m)] = experts
    count = len(replaced)
    modules = {}
    for key in list(replaced):  # dropped as wrapped: on CUDA each storage format is freed once its layout is made
        new = replaced.pop(key)
        modules[key] = KbitLinear._wrap(*new) if isinstance(new, tuple) else new
    for name, m in targets + expert_targets:
        if name == "":
            return modules[id(m)]
        model.set_submodule(name, modules[id(m)])
    if references is not None:
        layers = list({id(m): m for m in model.modules() if type(m) is KbitLinear}.values())
        tuned = tune_end_to_end(model, layers, tune_on, references, tune_steps)
        logger.info(f"quantize_model: {tune_steps} tuning steps, calibration loss {tuned['loss_before']:.4g} -> "
                    f"{tuned['loss_after']:.4g} ({'kept' if tuned['kept'] else 'not lower: the tuning is dropped'})")
    _fuse_siblings(model, fuse_projections)
    if uniform:
        described = f"{bits} bits"
    else:
        counts = [sum(1 for key in modules if key in ks and ks[key] == k) for k in SUPPORTED_BITS]
        described = "K = " + ", ".join(f"{k}: {c}" for k, c in zip(SUPPORTED_BITS, counts) if c) + " layers"
    summary = (f"quantize_model: {100 * quantized_fraction(model):.1f}% of {type(model).__name__}'s weights quantized "
               f"to {described} ({count} layers)")
    logger.info(summary)
    bar.close(summary)
    for hook in QUANTIZED_HOOKS:
        hook(model, bits=bits, skip=list(skip), min_features=min_features, codebook=codebook, rotate=rotate,
             method=method, tune_steps=tune_steps, fp_targets=fp_targets, block_tune_steps=block_tune_steps)
    return model


def quantized_fraction(model: nn.Module) -> float:
    """Share of ``model``'s weights (elements of quantized weights and of remaining parameters) in kbit storage."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    quantized = 0
    for m in model.modules():
        if isinstance(m, KbitLinear):
            quantized += m.in_features * m.out_features
        elif isinstance(m, KbitExperts):
            quantized += 3 * m.num_experts * m.hidden_dim * m.intermediate_dim
    total = quantized + sum(p.numel() for p in model.parameters())
    return quantized / total if total else 0.0


def fuse_projections(model: nn.Module, enabled: bool = True) -> int:
    """Group the sibling projections of ``model`` (``kbit.fusion.SIBLING_NAMES``) that can share one exact GEMM
    launch, or with ``enabled=False`` ungroup every kbit layer. Returns the number of groups. Groups already there
    are replaced.

    Fusion is on by default (``kbit.quantize_model``, ``KbitConfig``, loading a kbit folder); call this after
    loading to turn it off, or to group afresh after a group turned itself off (``kbit.fusion``). The stacked
    layout is built once every member is GEMM-resident (on CUDA); elsewhere members run their own GEMMs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    return _fuse_siblings(model, enabled)


def has_groups(model: nn.Module) -> bool:
    """Whether any kbit layer of ``model`` is grouped with its siblings (so that code replacing layers, such as
    tensor-parallel sharding, groups the new ones again)."""
    return any(isinstance(m, KbitLinear) and m._fusion is not None for m in model.modules())


def _fuse_siblings(model: nn.Module, enabled: bool) -> int:
    """``fuse_projections`` on arguments already checked."""
    for m in model.modules():
        if isinstance(m, KbitLinear) and m._fusion is not None:
            m._fusion, m._fusion_slot = None, 0  # its buffers stay views of the stacked layout: no copy, no growth
    if not enabled:
        return 0
    count = 0
    for members, names in groups_of(model, KbitLinear):
        reason = why_separate(members)
        if reason is not None:
            logger.debug("kbit: %s stay separate GEMM launches: %s", ", ".join(names), reason)
            continue
        group = FusedProjections(members, names)
        for slot, m in enumerate(members):
            m._fusion, m._fusion_slot = group, slot
        group.refresh()
        count += 1
    return count


def prepare(model: Union[nn.Module, QuantizedWeight]):
    """Derive every kbit layer's GEMM layout on its CUDA device now, before ``torch.compile`` or graph capture.

    Moving a model to CUDA already does this; call it after changing kbit buffers by hand. Returns its argument.
    """
    if isinstance(model, QuantizedWeight):
        return model.prepare()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a kbit.QuantizedWeight, got {type(model).__name__}")
    for m in model.modules():
        if isinstance(m, (KbitLinear, KbitExperts)):
            m.prepare()
    return model
