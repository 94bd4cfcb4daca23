"""QuantizedWeight and the high-level API: quantize, dequantize, matmul."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import ops
from .formats import (
    BLOCK_SIZE,
    check_bits,
    check_dtype,
    choose_tensor_scale,
    num_blocks,
)
from .functional import GEMM_DTYPES, _check_tensor, _resolve_codebook, check_finite

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# From this many tokens on, dequantize + cuBLAS beat the fused kernel's mma.sync path, per bit width. Measured on
# an H100 (benchmarks/results/gemm_NVIDIA_H100_80GB_HBM3_m128_256.md and _m160_224.md at faa39cf,
# docs/PERFORMANCE.md): the fused time grows by one weight pass per 32 tokens, so K = 2 ties at M = 160, K = 4
# at M = 192; at M = 256 dequantize + cuBLAS wins for every K. GPUs without the wgmma path use these.
DEQUANT_CUBLAS_MIN_M = {2: 160, 3: 160, 4: 192, 5: 128}
# Compute capability 9.x (the wgmma path, 128 tokens per weight pass), H100 at the wgmma commit
# (benchmarks/results/gemm_NVIDIA_H100_80GB_HBM3_m128_256.md): at M = 128 the fused kernel wins on every
# shape of >= 32M weights (8192->28672, K = 4: 197 vs 379 us; 14336->4096: 76 vs 107 us) and loses on smaller
# ones (4096->4096: 31 vs 27 us); past 128 tokens it takes a second pass, which still wins for weights of
# >= 128M at K <= 4 (370 vs 403 us at M = 256) and nowhere else.
WGMMA_FUSED_MIN_WEIGHTS = 1 << 25
WGMMA_FUSED_TWO_PASS_MIN_WEIGHTS = 1 << 27


@functools.lru_cache(maxsize=None)
def _has_wgmma_path(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def use_dequant_cublas(qw: "QuantizedWeight", M: int, device: torch.device) -> bool:
    """Whether dequantize + cuBLAS beats the fused kernel for M tokens on this CUDA device."""
    if not _has_wgmma_path(device.index if device.index is not None else torch.cuda.current_device()):
        return M >= DEQUANT_CUBLAS_MIN_M[qw.k]
    weights = qw.shape[0] * qw.shape[1]
    if M <= 128:  # one pass: 65..128 tokens cost what 128 do
        return M > 64 and weights < WGMMA_FUSED_MIN_WEIGHTS
    return M > 256 or weights < WGMMA_FUSED_TWO_PASS_MIN_WEIGHTS or qw.k == 5


_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
STATE_KEYS = ("packed", "absmax", "codebook", "scale", "meta")


def padded_in_features(K: int) -> int:
    """Columns of the stored matrix: K rounded up to a multiple of 32 (rows are zero-padded)."""
    return -(-K // BLOCK_SIZE) * BLOCK_SIZE


class QuantizedWeight:
    """A k-bit quantized [N, K] weight in the storage format, plus a cached GEMM layout.

    Storage: the [N, K_pad] matrix (K_pad = K rounded up to a multiple of 32, extra columns
    zero) flattened row-major and quantized in blocks of 32 (``kbit.formats``), so each block
    lies within one row. ``scale`` is the per-tensor power of two (a 0-dim float32 tensor).
    The GEMM layout (``kbit.layout``) is derived on first use on a CUDA device and cached; it is
    never saved.
    """

    def __init__(self, packed: Tensor, absmax: Tensor, codebook: Tensor, scale: Tensor, k: int, shape, dtype):
        check_bits(k)
        N, K = (int(s) for s in shape)
        nb = num_blocks(N * padded_in_features(K))
        if packed.shape != (nb * k,) or absmax.shape != (nb,) or codebook.shape != (2**k,) or scale.shape != ():
            raise ValueError(
                f"inconsistent QuantizedWeight for k={k}, shape=({N}, {K}): expected packed ({nb * k},), "
                f"absmax ({nb},), codebook ({2**k},), scale (); got {tuple(packed.shape)}, "
                f"{tuple(absmax.shape)}, {tuple(codebook.shape)}, {tuple(scale.shape)}"
            )
        self.packed, self.absmax, self.codebook, self.scale = packed, absmax, codebook, scale
        self.k, self.shape, self.dtype = k, (N, K), dtype
        self._gemm = None  # (device, b_gemm, absmax_gemm)

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored format (packed + absmax + codebook + scale)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.absmax, self.codebook, self.scale))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.shape[0] * self.shape[1])

    def __repr__(self) -> str:
        return (
            f"QuantizedWeight(shape={self.shape}, k={self.k}, dtype={str(self.dtype).replace('torch.', '')}, "
            f"device={self.device}, bits_per_weight={self.bits_per_weight:.3f})"
        )

    # ------------------------------------------------------------------ conversions
    def to(self, device) -> "QuantizedWeight":
        device = torch.device(device)
        moved = QuantizedWeight(
            self.packed.to(device), self.absmax.to(device), self.codebook.to(device), self.scale.to(device),
            self.k, self.shape, self.dtype,
        )
        if self._gemm is not None:  # the layout is plain data: moving it is valid
            moved._gemm = (device, self._gemm[1].to(device), self._gemm[2].to(device))
        return moved

    def cuda(self, device=None) -> "QuantizedWeight":
        return self.to(device if device is not None else "cuda")

    def cpu(self) -> "QuantizedWeight":
        return self.to("cpu")

    def gemm_layout(self):
        """(B_gemm, absmax_gemm) on this weight's device, derived once and cached."""
        if self._gemm is None or self._gemm[0] != self.device:
            b, a = ops.repack(self.packed, self.absmax, self.k, self.shape[0], padded_in_features(self.shape[1]))
            self._gemm = (self.device, b, a)
        return self._gemm[1], self._gemm[2]

    def dequantize(self, dtype=None) -> Tensor:
        dtype = self.dtype if dtype is None else dtype
        check_dtype(dtype, "dtype")
        N, K = self.shape
        kp = padded_in_features(K)
        flat = ops.dequantize(self.packed, self.absmax, self.codebook, self.k, N * kp, dtype, self.scale)
        w = flat.reshape(N, kp)
        return w if kp == K else w[:, :K].contiguous()

    # ------------------------------------------------------------------ serialization
    def meta_tensor(self) -> Tensor:
        return torch.tensor([self.k, self.shape[0], self.shape[1], _DTYPE_CODES[self.dtype]], dtype=torch.int64)

    def state_dict(self, prefix: str = "") -> dict:
        """Tensors only, so the dict saves with torch.save and safetensors alike."""
        return {
            prefix + "packed": self.packed, prefix + "absmax": self.absmax, prefix + "codebook": self.codebook,
            prefix + "scale": self.scale, prefix + "meta": self.meta_tensor(),
        }

    @classmethod
    def from_state_dict(cls, state: dict, prefix: str = "") -> "QuantizedWeight":
        missing = [key for key in STATE_KEYS if prefix + key not in state]
        if missing:
            raise KeyError(f"state dict lacks {', '.join(prefix + m for m in missing)}")
        k, N, K, code = (int(v) for v in state[prefix + "meta"].tolist())
        if code not in _CODE_DTYPES:
            raise ValueError(f"unknown dtype code {code} in {prefix}meta")
        return cls(
            state[prefix + "packed"], state[prefix + "absmax"], state[prefix + "codebook"], state[prefix + "scale"],
            k, (N, K), _CODE_DTYPES[code],
        )


# ---------------------------------------------------------------------- high-level API
def quantize(W: Tensor, k: int = 4, codebook: Optional[Tensor] = None) -> QuantizedWeight:
    """Quantize an [N, K] weight (nn.Linear layout, fp16/bf16/fp32, any N and K)."""
    _check_tensor(W, "W")
    check_bits(k)
    check_dtype(W.dtype, "W")
    if W.dim() != 2 or W.shape[0] == 0 or W.shape[1] == 0:
        raise ValueError(f"W must be a non-empty 2-D [N, K] tensor, got shape {tuple(W.shape)}")
    check_finite(W, "W")
    cb = _resolve_codebook(codebook, k, W.device)
    N, K = W.shape
    kp = padded_in_features(K)
    Wp = W.detach() if kp == K else torch.nn.functional.pad(W.detach(), (0, kp - K))
    scale = choose_tensor_scale(Wp.abs().amax())
    packed, absmax = ops.quantize(Wp.contiguous(), cb, k, scale)
    return QuantizedWeight(packed, absmax, cb, scale, k, (N, K), W.dtype)


def dequantize(qw: QuantizedWeight, dtype=None) -> Tensor:
    """The [N, K] reconstruction of ``qw`` in ``dtype`` (default: the dtype it was quantized from)."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a kbit.QuantizedWeight, got {type(qw).__name__}")
    return qw.dequantize(dtype)


def matmul(x: Tensor, qw: QuantizedWeight, bias: Optional[Tensor] = None, num_blocks: int = 0) -> Tensor:
    """``x @ dequantize(qw).T (+ bias)`` for x of shape [..., K]; fused kernel on CUDA.

    On CPU, the weight is dequantized in float32 and multiplied in float32. Never synchronizes.
    """
    _check_tensor(x, "x")
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a kbit.QuantizedWeight, got {type(qw).__name__}")
    N, K = qw.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must have shape [..., {K}] to multiply a [{N}, {K}] weight, got {tuple(x.shape)}")
    if x.device != qw.device:
        raise ValueError(f"x is on {x.device} but the weight is on {qw.device}")
    if bias is not None:
        _check_tensor(bias, "bias")
        if bias.shape != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x.device.type == "cuda":
        check_dtype(x.dtype, "x", GEMM_DTYPES)
        bias_c = None if bias is None else bias.to(x.dtype).contiguous()
        if num_blocks == 0 and use_dequant_cublas(qw, x2.shape[0], x.device):
            y = torch.nn.functional.linear(x2, qw.dequantize(x.dtype), bias_c)
        else:
            b, a = qw.gemm_layout()
            kp = padded_in_features(K)
            if K % 8:  # the kernel reads x in 16-byte rows
                x2 = torch.nn.functional.pad(x2, (0, kp - K))
            y = ops.gemm(x2.contiguous(), b, a, qw.codebook, qw.scale, bias_c, qw.k, N, kp, num_blocks)
    else:
        check_dtype(x.dtype, "x")
        w = qw.dequantize(torch.float32)
        y = x2.to(torch.float32) @ w.T
        if bias is not None:
            y = y + bias.to(torch.float32)
        y = y.to(x.dtype)
    return y.reshape(*lead, N)
