"""The seeds' functional API, validated: quantize_kbit, dequantize_kbit, repack_for_gemm, kbit_gemm.

These check their arguments (raising ``TypeError`` / ``ValueError`` that name the argument) and
then call the custom ops in ``kbit.ops``. Checks that need a value from the device (finiteness,
absmax range) synchronize once; the ops themselves never do.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import ops
from .formats import (
    BLOCK_SIZE,
    E4M4_MAX,
    E4M4_MIN_SUBNORMAL,
    check_bits,
    check_codebook,
    check_dtype,
    create_normal_float_codebook,
    num_blocks,
)
from .layout import gemm_shapes

GEMM_DTYPES = (torch.float16, torch.bfloat16)


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_same_device(**tensors) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            names = ", ".join(f"{n} on {d}" for n, d in devices.items())
            raise ValueError(f"all tensors must be on one device, got {names}")
    return first


def _scale_tensor(scale, device) -> Tensor:
    """Validate a per-tensor scale (a positive power of two) and return it as a 0-dim float32 tensor."""
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    t = torch.as_tensor(scale, dtype=torch.float32).reshape(()).to(device)
    value = float(t)
    if not (math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5):
        raise ValueError(f"scale must be a positive finite power of two, got {value}")
    return t


def _resolve_codebook(codebook, k: int, device) -> Tensor:
    if codebook is None:
        return create_normal_float_codebook(k, device=device)
    return check_codebook(codebook, k).to(device=device, copy=True)  # never an alias of the caller's tensor


def check_finite(A: Tensor, name: str) -> None:
    if A.device.type == "meta":
        raise ValueError(f"{name} is on the meta device and holds no values to quantize")
    if A.numel() and not bool(torch.isfinite(A).all()):
        bad = int((~torch.isfinite(A)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf value(s); kbit quantizes finite values only")


def quantize_kbit(A: Tensor, k: int = 4, codebook: Optional[Tensor] = None, scale=None):
    """Quantize a tensor of any shape (flattened) in blocks of 32: ``(packed, absmax, codebook)``.

    ``scale`` is an optional per-tensor power of two (see ``kbit.formats``): the block absmax of
    ``A / scale`` must fit E4M4's range, otherwise this raises (``kbit.quantize`` picks the scale
    for you).
    """
    _check_tensor(A, "A")
    check_bits(k)
    check_dtype(A.dtype, "A")
    check_finite(A, "A")
    cb = _resolve_codebook(codebook, k, A.device)
    s = _scale_tensor(scale, A.device)
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
    _check_tensor(packed, "packed")
    _check_tensor(absmax, "absmax")
    check_bits(k)
    if packed.dtype != torch.int32:
        raise TypeError(f"packed must be int32, got {packed.dtype}")
    if absmax.dtype != torch.uint8:
        raise TypeError(f"absmax must be uint8 (E4M4 codes), got {absmax.dtype}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    nb = num_blocks(n)
    if packed.numel() != nb * k or absmax.numel() != nb:
        raise ValueError(
            f"{n} elements at k={k} need {nb * k} packed words and {nb} absmax codes, "
            f"got {packed.numel()} and {absmax.numel()}"
        )
    cb = check_codebook(codebook, k)
    _check_same_device(packed=packed, absmax=absmax, codebook=codebook)
    return cb.to(packed.device)


def dequantize_kbit(packed, absmax, codebook, k: int, n: int, dtype=torch.float16, scale=None) -> Tensor:
    """Reconstruct the flat tensor of ``n`` elements in ``dtype`` (fp16, bf16 or fp32)."""
    check_dtype(dtype, "dtype")
    cb = _check_storage(packed, absmax, codebook, k, n)
    s = _scale_tensor(scale, packed.device)
    return ops.dequantize(packed.contiguous(), absmax.contiguous(), cb, k, n, dtype, s)


def repack_for_gemm(packed, absmax, k: int, N: int, K_dim: int):
    """Storage format of an [N, K_dim] weight -> the GEMM layout ``(B_gemm, absmax_gemm)``."""
    check_bits(k)
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
    _check_tensor(A, "A")
    check_bits(k)
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
        _check_tensor(bias, "bias")
        if bias.shape != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    cb = check_codebook(codebook, k)
    _check_same_device(A=A, b_gemm=b_gemm, absmax_gemm=absmax_gemm, codebook=codebook, bias=bias)
    s = _scale_tensor(scale, A.device)
    bias = None if bias is None else bias.to(A.dtype).contiguous()
    return ops.gemm(A.contiguous(), b_gemm, absmax_gemm, cb.to(A.device), s, bias, k, N, K_dim, int(num_blocks))
