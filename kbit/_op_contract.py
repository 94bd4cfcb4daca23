"""What the custom ops in ``kbit.ops`` accept, checked for every backend that is not the CUDA binding.

The CUDA binding (``kbit/csrc/binding.cpp``) checks what reaches a kernel in C++; the other implementations
(the pure-PyTorch reference on CPU or any device) call these first, so that a raw ``torch.ops.kbit.*`` call is
refused alike everywhere instead of computing from a broadcast, a wrong dtype or data that is not there.
They read no tensor values (no host synchronization) and raise ``ValueError`` / ``TypeError`` naming the argument.
The device itself is free (the reference runs anywhere); the tensors of one call share it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._validate import GEMM_DTYPES, INPUT_DTYPES, _dtype_name, check_dtype
from .formats import BLOCK_SIZE, SUPPORTED_BITS, block_count
from .layout import gemm_shapes, row_blocks


def _bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"kbit: bits must be one of {SUPPORTED_BITS}, got {bits}")


def _size(value: int, name: str, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"kbit: {name} must be >= {minimum}, got {value}")


def _tensor(t: Tensor, name: str, dtype: torch.dtype, shape, device: torch.device) -> None:
    """``t`` of exactly ``dtype`` and ``shape`` (None: any), contiguous, on ``device``."""
    if t.dtype != dtype:
        raise TypeError(f"kbit: {name} must be {_dtype_name(dtype)}, got {_dtype_name(t.dtype)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"kbit: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"kbit: {name} must be contiguous")
    if t.device != device:
        raise ValueError(f"kbit: {name} must be on {device} with the op's other tensors, got {t.device}")


def _codebook_and_scale(codebook: Tensor, scale: Tensor, bits: int, device: torch.device, rows: int = 0) -> None:
    """``rows`` > 0: the scale may also be one float32 per 256 of the ``rows`` output rows (``layout.row_blocks``:
    the GEMM of fused projections)."""
    _tensor(codebook, "codebook", torch.float32, (2**bits,), device)
    _tensor(scale, "scale", torch.float32, None, device)
    if scale.numel() != 1 and not (rows and tuple(scale.shape) == (row_blocks(rows),)):
        per_rows = f" or one per 256 output rows ({row_blocks(rows)},)" if rows else ""
        raise ValueError(f"kbit: scale must hold one float32{per_rows}, got shape {tuple(scale.shape)}")


def quantize(A: Tensor, codebook: Tensor, bits: int, scale: Tensor) -> None:
    _bits(bits)
    check_dtype(A.dtype, "kbit: A")
    _codebook_and_scale(codebook, scale, bits, A.device)


def dequantize(packed: Tensor, absmax: Tensor, codebook: Tensor, bits: int, n: int, dtype: torch.dtype,
               scale: Tensor) -> None:
    _bits(bits)
    _size(n, "n", 0)
    check_dtype(dtype, "kbit: dtype", INPUT_DTYPES)
    blocks = block_count(n)
    _tensor(packed, "packed", torch.int32, (blocks * bits,), packed.device)
    _tensor(absmax, "absmax", torch.uint8, (blocks,), packed.device)
    _codebook_and_scale(codebook, scale, bits, packed.device)


def _layout_sizes(bits: int, out_features: int, in_features_padded: int) -> None:
    _bits(bits)
    _size(out_features, "out_features", 1)
    _size(in_features_padded, "in_features_padded", BLOCK_SIZE)
    if in_features_padded % BLOCK_SIZE:
        raise ValueError(f"kbit: in_features_padded must be a multiple of {BLOCK_SIZE}, got {in_features_padded}")


def repack(packed: Tensor, absmax: Tensor, bits: int, out_features: int, in_features_padded: int) -> None:
    _layout_sizes(bits, out_features, in_features_padded)
    blocks = out_features * in_features_padded // BLOCK_SIZE
    _tensor(packed, "packed", torch.int32, (blocks * bits,), packed.device)
    _tensor(absmax, "absmax", torch.uint8, (blocks,), packed.device)


def unrepack(b_gemm: Tensor, absmax_gemm: Tensor, bits: int, out_features: int, in_features_padded: int) -> None:
    _layout_sizes(bits, out_features, in_features_padded)
    b_shape, a_shape = gemm_shapes(bits, out_features, in_features_padded)
    _tensor(b_gemm, "b_gemm", torch.int32, b_shape, b_gemm.device)
    _tensor(absmax_gemm, "absmax_gemm", torch.uint8, a_shape, b_gemm.device)


def _activations(x: Tensor, allowed, in_features_padded: int, device: torch.device, codebook: Tensor, scale: Tensor,
                 bits: int, scale_rows: int = 0) -> None:
    """x [tokens, <= in_features_padded] of an ``allowed`` dtype on the weight's device; codebook and scale (per
    256 rows allowed with ``scale_rows``)."""
    if x.dim() != 2:
        raise ValueError(f"kbit: x must be 2-D [tokens, in_features], got shape {tuple(x.shape)}")
    check_dtype(x.dtype, "kbit: x", allowed)
    if x.shape[1] > in_features_padded:
        raise ValueError(f"kbit: x has {x.shape[1]} columns, more than the weight's {in_features_padded}")
    if x.device != device:
        raise ValueError(f"kbit: x must be on {device} with the weight, got {x.device}")
    _codebook_and_scale(codebook, scale, bits, device, scale_rows)


def gemm(x: Tensor, b_gemm: Tensor, absmax_gemm: Tensor, codebook: Tensor, scale: Tensor, bias, bits: int,
         out_features: int, in_features_padded: int) -> None:
    unrepack(b_gemm, absmax_gemm, bits, out_features, in_features_padded)
    _activations(x, GEMM_DTYPES, in_features_padded, b_gemm.device, codebook, scale, bits, out_features)
    if bias is not None:
        _tensor(bias, "bias", x.dtype, (out_features,), x.device)


def matmul_stored(x: Tensor, packed: Tensor, absmax: Tensor, codebook: Tensor, scale: Tensor, bias, bits: int,
                  out_features: int, in_features_padded: int) -> None:
    # The storage-format GEMM (CPU kernel or reference) takes any float activations and a bias of any float dtype.
    repack(packed, absmax, bits, out_features, in_features_padded)
    _activations(x, INPUT_DTYPES, in_features_padded, packed.device, codebook, scale, bits)
    if bias is not None:
        check_dtype(bias.dtype, "kbit: bias", INPUT_DTYPES)
        if tuple(bias.shape) != (out_features,) or bias.device != x.device:
            raise ValueError(f"kbit: bias must have shape ({out_features},) on {x.device}, got "
                             f"{tuple(bias.shape)} on {bias.device}")
