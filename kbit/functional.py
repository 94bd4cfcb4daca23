"""The seeds' functional API, validated: quantize_kbit, dequantize_kbit, repack_for_gemm, kbit_gemm.

These check their arguments (raising ``TypeError`` / ``ValueError`` that name the argument) and
then call the custom ops in ``kbit.ops``. Checks that need a value from the device (finiteness,
absmax range) synchronize once; the ops themselves never do.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ops
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
)
from .formats import BLOCK_SIZE, E4M4_MAX, E4M4_MIN_SUBNORMAL, create_normal_float_codebook, num_blocks
from .layout import gemm_shapes
from .weight import resolve_codebook


def quantize_kbit(A: Tensor, k: int = 4, codebook: Optional[Tensor] = None, scale=None):
    """Quantize a tensor of any shape (flattened) in blocks of 32: ``(packed, absmax, codebook)``.

    ``scale`` is an optional per-tensor power of two (see ``kbit.formats``): the block absmax of
    ``A / scale`` must fit E4M4's range, otherwise this raises (``kbit.quantize`` picks the scale
    for you).
    """
    check_tensor(A, "A")
    k = check_bits(k)
    check_dtype(A.dtype, "A")
    check_finite(A, "A")
    cb = resolve_codebook(codebook, k, A.device)
    s = check_scale(scale, A.device)
    if A.numel():
        amax = A.detach().reshape(-1).float().abs()
        amax = torch.nn.functional.pad(amax, (0, num_blocks(amax.numel()) * BLOCK_SIZE - amax.numel()))
        amax = amax.reshape(-1, BLOCK_SIZE).amax(dim=1) / s
        too_big = int((amax > E4M4_MAX).sum())
        too_small = int(((amax > 0) & (amax < E4M4_MIN_SUBNORMAL / 2)).sum())
        if too_big or too_small:
            raise ValueError(
                f"{too_big + too_small} block absmax value(s) of A/scale fall outside E4M4's range "
                f"[{E4M4_MIN_SUBNORMAL:.3g}, {E4M4_MAX:g}] (largest {float(amax.max()):.4g}); pass a power-of-two "
                f"scale=, or use kbit.quantize(), which chooses one"
            )
    packed, absmax = ops.quantize(A.detach(), cb, k, s)
    return packed, absmax, cb


def _check_storage(packed, absmax, codebook, k: int, n: int):
    check_tensor(packed, "packed")
    check_tensor(absmax, "absmax")
    if packed.dtype != torch.int32:
        raise TypeError(f"packed must be int32, got {packed.dtype}")
    if absmax.dtype != torch.uint8:
        raise TypeError(f"absmax must be uint8 (E4M4 codes), got {absmax.dtype}")
    nb = num_blocks(n)
    if packed.shape != (nb * k,) or absmax.shape != (nb,):
        raise ValueError(
            f"{n} elements at k={k} need packed of shape ({nb * k},) and absmax of shape ({nb},), "
            f"got {tuple(packed.shape)} and {tuple(absmax.shape)}"
        )
    cb = check_codebook(codebook, k)
    check_same_device(packed=packed, absmax=absmax, codebook=codebook)
    return cb.to(packed.device)


def dequantize_kbit(packed, absmax, codebook, k: int, n: int, dtype=torch.float16, scale=None) -> Tensor:
    """Reconstruct the flat tensor of ``n`` elements in ``dtype`` (fp16, bf16 or fp32)."""
    check_dtype(dtype, "dtype")
    k, n = check_bits(k), check_int(n, "n", 0)
    cb = _check_storage(packed, absmax, codebook, k, n)
    s = check_scale(scale, packed.device)
    return ops.dequantize(packed.contiguous(), absmax.contiguous(), cb, k, n, dtype, s)


def repack_for_gemm(packed, absmax, k: int, N: int, K_dim: int):
    """Storage format of an [N, K_dim] weight -> the GEMM layout ``(B_gemm, absmax_gemm)``."""
    k, N, K_dim = check_bits(k), check_int(N, "N", 1), check_int(K_dim, "K_dim", 1)
    if K_dim % BLOCK_SIZE:
        raise ValueError(f"K_dim must be a multiple of {BLOCK_SIZE} for the GEMM layout, got {K_dim}")
    _check_storage(packed, absmax, create_normal_float_codebook(k), k, N * K_dim)
    return ops.repack(packed.contiguous(), absmax.contiguous(), k, N, K_dim)


def kbit_gemm(
    A: Tensor,
    b_gemm: Tensor,
    absmax_gemm: Tensor,
    codebook: Tensor,
    k: int,
    N: int,
    K_dim: int,
    bias: Optional[Tensor] = None,
    scale=None,
    num_blocks: int = 0,
) -> Tensor:
    """C[M, N] = A[M, K_dim] @ W_hat[N, K_dim]^T (+ bias) from the GEMM layout."""
    check_tensor(A, "A")
    k, N, K_dim = check_bits(k), check_int(N, "N", 1), check_int(K_dim, "K_dim", 1)
    num_blocks = check_int(num_blocks, "num_blocks", 0)
    if K_dim % BLOCK_SIZE:
        raise ValueError(f"K_dim must be a multiple of {BLOCK_SIZE} (the GEMM layout's row length), got {K_dim}")
    for name, t in (("b_gemm", b_gemm), ("absmax_gemm", absmax_gemm)):
        check_tensor(t, name)
    if b_gemm.dtype != torch.int32 or absmax_gemm.dtype != torch.uint8:
        raise TypeError(f"the GEMM layout must be (int32, uint8) tensors, got ({b_gemm.dtype}, {absmax_gemm.dtype})")
    check_dtype(A.dtype, "A", GEMM_DTYPES)
    if A.dim() != 2 or A.shape[1] > K_dim:
        raise ValueError(f"A must be [M, K] with K <= K_dim={K_dim}, got shape {tuple(A.shape)}")
    b_shape, a_shape = gemm_shapes(k, N, K_dim)
    if tuple(b_gemm.shape) != b_shape or tuple(absmax_gemm.shape) != a_shape:
        raise ValueError(
            f"GEMM layout of a k={k} [{N}, {K_dim}] weight must have shapes {b_shape} and {a_shape}, "
            f"got {tuple(b_gemm.shape)} and {tuple(absmax_gemm.shape)}"
        )
    if bias is not None:
        check_tensor(bias, "bias")
        if bias.shape != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    cb = check_codebook(codebook, k)
    check_same_device(A=A, b_gemm=b_gemm, absmax_gemm=absmax_gemm, codebook=codebook, bias=bias)
    s = check_scale(scale, A.device)
    bias = None if bias is None else bias.to(A.dtype).contiguous()
    return ops.gemm(A.contiguous(), b_gemm.contiguous(), absmax_gemm.contiguous(), cb.to(A.device), s, bias, k, N,
                    K_dim, num_blocks)
