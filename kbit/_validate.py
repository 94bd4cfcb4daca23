"""Argument checks shared by the public API: each raises ``TypeError`` or ``ValueError`` naming the argument.

The public functions (``kbit.quantize``, ``kbit.matmul``, ``QuantizedWeight``, ``KbitLinear``, the seeds'
functional API) call these once at their boundary; the custom ops in ``kbit.ops`` trust their arguments,
and the CUDA binding checks again what reaches a kernel (dtype, shape, device, contiguity).

Checks that read tensor values (``check_codebook``, ``check_scale``, ``check_finite``) synchronize with
the device; they run when a weight is quantized or loaded, never per forward.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .formats import BLOCK_SIZE, CODE_DTYPES, SUPPORTED_BITS, num_blocks, padded_in_features

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what quantize reads and dequantize writes
GEMM_DTYPES = (torch.float16, torch.bfloat16)  # activations of the fused GEMM
# A codebook's largest |value| must be 1 (its levels are multiples of the block absmax); float32 rounding of a
# user's normalization is allowed this much slack.
CODEBOOK_MAX_TOLERANCE = 1e-6


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(t, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_int(value, name: str, minimum: int = None) -> int:
    """A Python (or numpy / 0-dim integer tensor) integer, not a bool or a float; at least ``minimum``."""
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bits(k) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int in {SUPPORTED_BITS} (bits per weight), got {type(k).__name__}")
    if int(k) not in SUPPORTED_BITS:
        raise ValueError(f"k must be one of {SUPPORTED_BITS} (bits per weight), got {k}")
    return int(k)


def check_dtype(dtype, name: str, allowed=INPUT_DTYPES) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {_dtype_name(dtype)}")
    return dtype


def check_not_meta(t: Tensor, name: str) -> None:
    if t.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device and holds no values (was it missing from the checkpoint that was loaded?)"
        )


def check_same_device(**tensors) -> torch.device:
    """All non-None tensors on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        names = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {names}")
    return first


def check_finite(A: Tensor, name: str) -> None:
    check_not_meta(A, name)
    if A.numel() and not bool(torch.isfinite(A).all()):
        bad = int((~torch.isfinite(A)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf value(s); kbit quantizes finite values only")


def check_codebook(codebook, k: int, name: str = "codebook") -> Tensor:
    """2**k finite levels, strictly ascending, largest |value| 1. Returns them as contiguous float32."""
    check_tensor(codebook, name)
    if not codebook.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {_dtype_name(codebook.dtype)}")
    if codebook.dim() != 1 or codebook.numel() != 2**k:
        raise ValueError(f"{name} for k={k} must be 1-D with {2**k} entries, got shape {tuple(codebook.shape)}")
    check_not_meta(codebook, name)
    cb = codebook.detach().to(torch.float32)
    if not bool(torch.isfinite(cb).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    if not bool((cb[1:] > cb[:-1]).all()):
        raise ValueError(f"{name} must be sorted strictly ascending")
    peak = float(cb.abs().max())
    if abs(peak - 1.0) > CODEBOOK_MAX_TOLERANCE:
        raise ValueError(
            f"{name} values must lie in [-1, 1] with largest |value| exactly 1 (levels are multiples of the "
            f"block absmax), got largest |value| {peak:.6g}; divide it by its largest |value|"
        )
    return cb.contiguous()


def check_scale(scale, device, name: str = "scale") -> Tensor:
    """A per-tensor scale: a positive, finite power of two (None means 1). Returns a 0-dim float32 tensor."""
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    if isinstance(scale, Tensor):
        check_not_meta(scale, name)
        if scale.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {tuple(scale.shape)}")
        if not scale.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {_dtype_name(scale.dtype)}")
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a float or a one-element tensor, got {type(scale).__name__}")
    t = torch.as_tensor(scale).detach().to(dtype=torch.float32).reshape(()).to(device)
    value = float(t)
    if not (math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5):
        raise ValueError(f"{name} must be a positive finite power of two, got {value}")
    return t


def check_meta(meta, name: str = "meta"):
    """The ``meta`` tensor of a saved weight: int [k, out_features, in_features, dtype code] -> (k, (N, K), dtype)."""
    check_tensor(meta, name)
    check_not_meta(meta, name)
    if meta.is_floating_point() or meta.is_complex() or meta.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {_dtype_name(meta.dtype)}")
    if tuple(meta.shape) != (4,):
        raise ValueError(f"{name} must have shape (4,) [k, out_features, in_features, dtype code], "
                         f"got {tuple(meta.shape)}")
    k, N, K, code = (int(v) for v in meta.tolist())
    try:
        k = check_bits(k)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: {e}") from None
    if N <= 0 or K <= 0:
        raise ValueError(f"{name} describes a [{N}, {K}] weight; both sizes must be positive")
    if code not in CODE_DTYPES:
        raise ValueError(f"{name} holds unknown dtype code {code} (known: {sorted(CODE_DTYPES)})")
    return k, (N, K), CODE_DTYPES[code]


def storage_spec(key: str, k: int, shape):
    """(dtype, shape) of one storage tensor of a k-bit [N, K] weight."""
    N, K = shape
    nb = num_blocks(N * padded_in_features(K))
    return {"packed": (torch.int32, (nb * k,)), "absmax": (torch.uint8, (nb,)),
            "codebook": (torch.float32, (2**k,)), "scale": (torch.float32, ())}[key]


def check_storage_tensor(t, key: str, k: int, shape, prefix: str = "") -> None:
    """Dtype, shape and contiguity of storage tensor ``key`` (no values read)."""
    check_tensor(t, prefix + key)
    dtype, want = storage_spec(key, k, shape)
    if t.dtype != dtype:
        raise TypeError(f"{prefix}{key} must be {_dtype_name(dtype)}, got {_dtype_name(t.dtype)}")
    if tuple(t.shape) != want:
        raise ValueError(
            f"{prefix}{key} of a k={k} [{shape[0]}, {shape[1]}] weight (blocks of {BLOCK_SIZE}) must have shape "
            f"{want}, got {tuple(t.shape)}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{prefix}{key} must be contiguous")


def check_storage(packed, absmax, codebook, scale, k: int, shape, prefix: str = "") -> None:
    """Dtypes, shapes and devices of a [N, K] weight's storage (no values read: cheap, safe while tracing)."""
    tensors = {"packed": packed, "absmax": absmax, "codebook": codebook, "scale": scale}
    for key, t in tensors.items():
        check_storage_tensor(t, key, k, shape, prefix)
    check_same_device(**{prefix + key: t for key, t in tensors.items()})
