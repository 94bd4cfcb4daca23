"""The seeds' functional API on raw tensors, validated: a thin layer over ``kbit.formats`` and the ``kbit::`` ops.

    from kbit.functional import quantize_kbit, dequantize_kbit, repack_for_gemm, kbit_gemm
    packed, absmax, codebook = quantize_kbit(A, bits=4)           # A of any shape, flattened
    A_hat = dequantize_kbit(packed, absmax, codebook, 4, A.numel(), A.dtype)

Nothing else in kbit imports this module. Each function checks its arguments (raising ``TypeError`` /
``ValueError`` that name the argument) and calls the reference or op that does the work. Checks that need a
value from the device (finiteness, absmax range) synchronize once; the ops themselves never do.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import formats, ops
from ._validate import (
    GEMM_DTYPES,
    check_bits,
    check_codebook,
    check_dtype,
    check_finite,
    check_int,
    check_same_device,
    check_scale,
    check_tensor,
    codebook_for,
)
from .formats import BLOCK_SIZE, E4M4_MAX, E4M4_MIN_SUBNORMAL, block_count
from .layout import gemm_shapes

__all__ = [
    "create_normal_float_codebook", "encode_absmax_e4m4", "decode_absmax_e4m4", "quantize_kbit", "dequantize_kbit",
    "repack_for_gemm", "kbit_gemm",
]


def create_normal_float_codebook(bits: int = 4, device=None) -> Tensor:
    """The normal-float codebook: 2**bits sorted levels, max |value| == 1 (``kbit.formats``)."""
    return formats.create_normal_float_codebook(check_bits(bits), device=device)


def encode_absmax_e4m4(x: Tensor) -> Tensor:
    """Encode finite, non-negative values as E4M4 uint8, round-to-nearest-even, saturating at 31."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"encode_absmax_e4m4 expects a floating-point torch.Tensor, got {type(x).__name__}"
                        + (f" of {x.dtype}" if isinstance(x, Tensor) else ""))
    if bool((x < 0).any()) or not bool(torch.isfinite(x).all()):
        raise ValueError("encode_absmax_e4m4 expects finite, non-negative values")
    return formats.encode_absmax_e4m4(x)


def decode_absmax_e4m4(code: Tensor) -> Tensor:
    """Decode E4M4 uint8 codes to float32 (exact)."""
    if not isinstance(code, Tensor) or code.dtype != torch.uint8:
        got = code.dtype if isinstance(code, Tensor) else type(code).__name__
        raise TypeError(f"decode_absmax_e4m4 expects a uint8 torch.Tensor of E4M4 codes, got {got}")
    return formats.decode_absmax_e4m4(code)


def quantize_kbit(A: Tensor, bits: int = 4, codebook: Optional[Tensor] = None, scale=None):
    """Quantize a tensor of any shape (flattened) in blocks of 32: ``(packed, absmax, codebook)``.

    ``scale`` is an optional per-tensor power of two (see ``kbit.formats``): the block absmax of
    ``A / scale`` must fit E4M4's range, otherwise this raises (``kbit.quantize`` picks the scale
    for you).
    """
    check_tensor(A, "A")
    bits = check_bits(bits)
    check_dtype(A.dtype, "A")
    check_finite(A, "A")
    cb = codebook_for(codebook, bits, A.device)
    s = check_scale(scale, A.device)
    if A.numel():
        amax = A.detach().reshape(-1).float().abs()
        amax = torch.nn.functional.pad(amax, (0, block_count(amax.numel()) * BLOCK_SIZE - amax.numel()))
        amax = amax.reshape(-1, BLOCK_SIZE).amax(dim=1) / s
        too_big = int((amax > E4M4_MAX).sum())
        too_small = int(((amax > 0) & (amax < E4M4_MIN_SUBNORMAL / 2)).sum())
        if too_big or too_small:
            raise ValueError(
                f"{too_big + too_small} block absmax value(s) of A/scale fall outside E4M4's range "
                f"[{E4M4_MIN_SUBNORMAL:.3g}, {E4M4_MAX:g}] (largest {float(amax.max()):.4g}); pass a power-of-two "
                f"scale=, or use kbit.quantize(), which chooses one"
            )
    packed, absmax = ops.quantize(A.detach(), cb, bits, s)
    return packed, absmax, cb


def _check_storage(packed, absmax, bits: int, n: int) -> None:
    check_tensor(packed, "packed")
    check_tensor(absmax, "absmax")
    if packed.dtype != torch.int32:
        raise TypeError(f"packed must be int32, got {packed.dtype}")
    if absmax.dtype != torch.uint8:
        raise TypeError(f"absmax must be uint8 (E4M4 codes), got {absmax.dtype}")
    blocks = block_count(n)
    if packed.shape != (blocks * bits,) or absmax.shape != (blocks,):
        raise ValueError(
            f"{n} elements at bits={bits} need packed of shape ({blocks * bits},) and absmax of shape ({blocks},), "
            f"got {tuple(packed.shape)} and {tuple(absmax.shape)}"
        )
    check_same_device(packed=packed, absmax=absmax)


def dequantize_kbit(packed, absmax, codebook, bits: int, n: int, dtype=torch.float16, scale=None) -> Tensor:
    """Reconstruct the flat tensor of ``n`` elements in ``dtype`` (fp16, bf16 or fp32)."""
    check_dtype(dtype, "dtype")
    bits, n = check_bits(bits), check_int(n, "n", 0)
    _check_storage(packed, absmax, bits, n)
    cb = check_codebook(codebook, bits)
    check_same_device(packed=packed, codebook=codebook)
    s = check_scale(scale, packed.device)
    return ops.dequantize(packed.contiguous(), absmax.contiguous(), cb.to(packed.device), bits, n, dtype, s)


def _check_layout_dims(bits, out_features, in_features_padded):
    bits = check_bits(bits)
    out_features = check_int(out_features, "out_features", 1)
    in_features_padded = check_int(in_features_padded, "in_features_padded", 1)
    if in_features_padded % BLOCK_SIZE:
        raise ValueError(f"in_features_padded must be a multiple of {BLOCK_SIZE} (the GEMM layout's row length), "
                         f"got {in_features_padded}")
    return bits, out_features, in_features_padded


def repack_for_gemm(packed, absmax, bits: int, out_features: int, in_features_padded: int):
    """Storage format of an [out_features, in_features_padded] weight -> the GEMM layout ``(B_gemm, absmax_gemm)``."""
    bits, out_features, in_features_padded = _check_layout_dims(bits, out_features, in_features_padded)
    _check_storage(packed, absmax, bits, out_features * in_features_padded)
    return ops.repack(packed.contiguous(), absmax.contiguous(), bits, out_features, in_features_padded)


def kbit_gemm(
    A: Tensor,
    b_gemm: Tensor,
    absmax_gemm: Tensor,
    codebook: Tensor,
    bits: int,
    out_features: int,
    in_features_padded: int,
    bias: Optional[Tensor] = None,
    scale=None,
    grid_override: int = 0,
) -> Tensor:
    """C[M, out_features] = A[M, in_features_padded] @ W_hat[out_features, in_features_padded]^T (+ bias) from the
    GEMM layout. A may have fewer columns than ``in_features_padded`` (the rest count as zeros)."""
    check_tensor(A, "A")
    bits, out_features, in_features_padded = _check_layout_dims(bits, out_features, in_features_padded)
    grid_override = check_int(grid_override, "grid_override", 0)
    for name, t in (("b_gemm", b_gemm), ("absmax_gemm", absmax_gemm)):
        check_tensor(t, name)
    if b_gemm.dtype != torch.int32 or absmax_gemm.dtype != torch.uint8:
        raise TypeError(f"the GEMM layout must be (int32, uint8) tensors, got ({b_gemm.dtype}, {absmax_gemm.dtype})")
    check_dtype(A.dtype, "A", GEMM_DTYPES)
    if A.dim() != 2 or A.shape[1] > in_features_padded:
        raise ValueError(f"A must be [M, K] with K <= in_features_padded={in_features_padded}, got shape "
                         f"{tuple(A.shape)}")
    b_shape, a_shape = gemm_shapes(bits, out_features, in_features_padded)
    if tuple(b_gemm.shape) != b_shape or tuple(absmax_gemm.shape) != a_shape:
        raise ValueError(
            f"GEMM layout of a bits={bits} [{out_features}, {in_features_padded}] weight must have shapes {b_shape} "
            f"and {a_shape}, got {tuple(b_gemm.shape)} and {tuple(absmax_gemm.shape)}"
        )
    if bias is not None:
        check_tensor(bias, "bias")
        if bias.shape != (out_features,):
            raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
    cb = check_codebook(codebook, bits)
    check_same_device(A=A, b_gemm=b_gemm, absmax_gemm=absmax_gemm, codebook=codebook, bias=bias)
    s = check_scale(scale, A.device)
    bias = None if bias is None else bias.to(A.dtype).contiguous()
    return ops.gemm(A.contiguous(), b_gemm.contiguous(), absmax_gemm.contiguous(), cb.to(A.device), s, bias, bits,
                    out_features, in_features_padded, grid_override)
