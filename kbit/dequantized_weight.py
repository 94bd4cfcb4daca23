"""``DequantizedWeight``: what ``KbitLinear.weight`` returns, a tensor standing for the dequantized weight.

Model code reads ``proj.weight.dtype`` / ``.device`` / ``.shape`` (to cast activations, to place adapters) and
sometimes computes with it (``F.linear(x, proj.weight)``). A ``DequantizedWeight`` answers the metadata of the
original weight without computing anything, and dequantizes only inside an operation that reads its values; the
result of that operation is a plain tensor and nothing is kept, so holding the view holds no full-precision copy.

It is read-only: an in-place operation on it, on its ``.data`` (which is itself) or assigning ``.data`` raises
``TypeError`` (it would change a temporary copy, not the stored weight; writing the stored one would re-quantize
it). That is also what refuses PEFT's ``merge_and_unload`` on a kbit layer. ``.tolist()`` and ``.numpy()`` give the
dequantized values, as any operation does.
The weight of a rotated layer (``kbit.rotation``) is the un-rotated one, in the layer's own input basis.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from .rotation import Rotation
from .weight import QuantizedWeight, warn_overflow

__all__ = ["DequantizedWeight"]

# Names of the tensors a QuantizedWeight holds (``QuantizedWeight.resident``), in the storage format or GEMM-resident.
_STORAGE = ("packed", "absmax", "codebook", "scale")
_GEMM_RESIDENT = ("gemm_codes", "gemm_absmax", "codebook", "scale")
_READ_ONLY = ("a KbitLinear's weight is stored quantized and is read-only: writing it (or merging a LoRA adapter "
              "into it) would re-quantize it, lossy. dequantize() it for a writable copy; to merge an adapter, load "
              "the model in full precision, apply the adapter there (PeftModel.from_pretrained) and "
              "merge_and_unload() that")


class DequantizedWeight(Tensor):
    """A [out_features, in_features] tensor of the original dtype whose values are ``qweight.dequantize()``,
    un-rotated by ``rotation`` when the stored weight is rotated."""

    @staticmethod
    def __new__(cls, qweight: QuantizedWeight, rotation: Optional[Rotation] = None):
        if not isinstance(qweight, QuantizedWeight):
            raise TypeError(f"qweight must be a kbit.QuantizedWeight, got {type(qweight).__name__}")
        return Tensor._make_wrapper_subclass(cls, qweight.shape, dtype=qweight.dtype, device=qweight.device,
                                             requires_grad=False)

    def __init__(self, qweight: QuantizedWeight, rotation: Optional[Rotation] = None):
        self.qweight, self.rotation = qweight, rotation
        # The held tensors as attributes: what __tensor_flatten__ names for torch.compile. Never the derived storage
        # of a GEMM-resident weight: reading the view's metadata must not derive anything.
        self._names = _GEMM_RESIDENT if qweight.is_gemm_resident else _STORAGE
        for name, t in zip(self._names, qweight.resident):
            setattr(self, name, t)
        # transformers' weight initialization (of layers a checkpoint lacks) skips tensors marked loaded: a
        # quantized weight always is, and cannot be written.
        self._is_hf_initialized = True

    def dequantize(self, dtype=None) -> Tensor:
        """The weight as a plain tensor (default: its original dtype)."""
        if self.rotation is None:
            return self.qweight.dequantize(dtype)
        w = self.rotation.unrotate(self.qweight.dequantize(torch.float32))
        return warn_overflow(w.to(self.qweight.dtype if dtype is None else dtype), self.qweight.dtype)

    # Tensor's own .data of a wrapper is a storage-less plain tensor that accepts writes and drops them.
    @property
    def data(self) -> "DequantizedWeight":
        return self

    @data.setter
    def data(self, value) -> None:
        raise TypeError(f"assigning .data: {_READ_ONLY}")

    def tolist(self) -> list:
        return self.dequantize().tolist()

    def numpy(self, *, force: bool = False):
        return self.dequantize().numpy(force=force)

    def __repr__(self, *, tensor_contents=None) -> str:  # printing must not dequantize
        qw = self.qweight
        return (f"DequantizedWeight(shape={list(qw.shape)}, dtype={str(qw.dtype).replace('torch.', '')}, "
                f"device={qw.device}, bits={qw.bits})")

    def __deepcopy__(self, memo):
        return DequantizedWeight(copy.deepcopy(self.qweight, memo), copy.deepcopy(self.rotation, memo))

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func._schema.is_mutable:
            raise TypeError(f"{func.__name__}: {_READ_ONLY}")

        def materialize(t):
            return t.dequantize() if isinstance(t, DequantizedWeight) else t

        return func(*tree_map(materialize, args), **tree_map(materialize, kwargs or {}))

    # torch.compile traces a tensor subclass through these two: the held tensors and what describes them.
    def __tensor_flatten__(self):
        qw, rotation = self.qweight, self.rotation
        gemm = qw.is_gemm_resident
        if rotation is None:
            return list(self._names), (qw.bits, qw.shape, qw.dtype, 0, gemm)
        self.rotation_signs = rotation.signs
        return list(self._names) + ["rotation_signs"], (qw.bits, qw.shape, qw.dtype, rotation.block, gemm)

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        bits, shape, dtype, block, gemm = context
        rotation = Rotation(inner["rotation_signs"], block) if block else None
        make = QuantizedWeight.from_gemm_layout if gemm else QuantizedWeight.from_checked
        qw = make(*(inner[name] for name in (_GEMM_RESIDENT if gemm else _STORAGE)), bits, shape, dtype)
        return DequantizedWeight(qw, rotation)
