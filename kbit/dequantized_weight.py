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
from .weight import QuantizedWeight

__all__ = ["DequantizedWeight"]

_STORAGE = ("packed", "absmax", "codebook", "scale")
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
        # The storage tensors as attributes: what __tensor_flatten__ names for torch.compile.
        self.packed, self.absmax, self.codebook, self.scale = (getattr(qweight, name) for name in _STORAGE)
        # transformers' weight initialization (of layers a checkpoint lacks) skips tensors marked loaded: a
        # quantized weight always is, and cannot be written.
        self._is_hf_initialized = True

    def dequantize(self, dtype=None) -> Tensor:
        """The weight as a plain tensor (default: its original dtype)."""
        if self.rotation is None:
            return self.qweight.dequantize(dtype)
        w = self.rotation.unrotate(self.qweight.dequantize(torch.float32))
        return w.to(self.qweight.dtype if dtype is None else dtype)

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

    # torch.compile traces a tensor subclass through these two: the storage tensors and what describes them.
    def __tensor_flatten__(self):
        qw, rotation = self.qweight, self.rotation
        if rotation is None:
            return list(_STORAGE), (qw.bits, qw.shape, qw.dtype, 0)
        self.rotation_signs = rotation.signs
        return list(_STORAGE) + ["rotation_signs"], (qw.bits, qw.shape, qw.dtype, rotation.block)

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        bits, shape, dtype, block = context
        rotation = Rotation(inner["rotation_signs"], block) if block else None
        qw = QuantizedWeight.from_checked(*(inner[name] for name in _STORAGE), bits, shape, dtype)
        return DequantizedWeight(qw, rotation)
