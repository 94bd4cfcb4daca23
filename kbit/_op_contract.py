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
from .grouped import GATE_UP_GROUP
from .layout import X_ALIGN, gemm_shapes, row_blocks


def _bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"kbit: bits must be one of {SUPPORTED_BITS}, got {bits}")


def _size(value: int, name: str, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"kbit: {name} must be >= {minimum}, got {value}")


def _rank(t: Tensor, name: str, dims: int, what: str) -> None:
    if t.dim() != dims:
        raise ValueError(f"kbit: {name} must be {what}, got shape {tuple(t.shape)}")


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


def dequantize_layout(b_gemm: Tensor, absmax_gemm: Tensor, codebook: Tensor, bits: int, out_features: int,
                      in_features_padded: int, dtype: torch.dtype, scale: Tensor) -> None:
    unrepack(b_gemm, absmax_gemm, bits, out_features, in_features_padded)
    check_dtype(dtype, "kbit: dtype", INPUT_DTYPES)
    _codebook_and_scale(codebook, scale, bits, b_gemm.device)


def _activations(x: Tensor, allowed, in_features_padded: int, device: torch.device, codebook: Tensor, scale: Tensor,
                 bits: int, scale_rows: int = 0) -> None:
    """x [tokens, <= in_features_padded] of an ``allowed`` dtype on the weight's device; codebook and scale (per
    256 rows allowed with ``scale_rows``)."""
    _rank(x, "x", 2, "2-D [tokens, in_features]")
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


# ----------------------------------------------------------------------------- the MoE ops (kbit.grouped)
def moe_route(expert_ids: Tensor, weights: Tensor, num_experts: int, rows_per_pass: int) -> None:
    _rank(expert_ids, "expert_ids", 2, "2-D [tokens, top_k]")
    if expert_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"kbit: expert_ids must be int64 or int32, got {_dtype_name(expert_ids.dtype)}")
    _tensor(expert_ids, "expert_ids", expert_ids.dtype, None, expert_ids.device)
    check_dtype(weights.dtype, "kbit: weights", INPUT_DTYPES)
    _tensor(weights, "weights", weights.dtype, expert_ids.shape, expert_ids.device)
    _size(expert_ids.shape[1], "top_k", 1)
    _size(num_experts, "num_experts", 1)
    _size(rows_per_pass, "rows_per_pass", 1)


def moe_gemm(x: Tensor, b_gemm: Tensor, absmax_gemm: Tensor, codebook: Tensor, scale: Tensor, x_rows, row_weights,
             passes: Tensor, num_passes: Tensor, bits: int, out_features: int, in_features_padded: int,
             rows_per_pass: int, silu_gate: bool, grid_override: int) -> None:
    """The experts' GEMM layouts stacked [E, ...]; x [rows, columns], a multiple of ``X_ALIGN`` columns, read in
    place (the CUDA kernel reads 16-byte pieces of it); the routing tables as ``moe_route`` makes them."""
    _layout_sizes(bits, out_features, in_features_padded)
    _size(rows_per_pass, "rows_per_pass", 1)
    _size(grid_override, "grid_override", 0)
    _rank(x, "x", 2, "2-D [rows, in_features]")
    check_dtype(x.dtype, "kbit: x", GEMM_DTYPES)
    _tensor(x, "x", x.dtype, None, x.device)
    if x.shape[1] % X_ALIGN or x.shape[1] > in_features_padded:
        raise ValueError(f"kbit: x must have a multiple of {X_ALIGN} columns, at most in_features_padded = "
                         f"{in_features_padded}, got {x.shape[1]}")
    _rank(b_gemm, "b_gemm", 7, "the experts' GEMM layouts stacked [experts, ...]")
    experts = b_gemm.shape[0]
    _size(experts, "the number of experts", 1)
    b_shape, a_shape = gemm_shapes(bits, out_features, in_features_padded)
    _tensor(b_gemm, "b_gemm", torch.int32, (experts, *b_shape), x.device)
    _tensor(absmax_gemm, "absmax_gemm", torch.uint8, (experts, *a_shape), x.device)
    _tensor(codebook, "codebook", torch.float32, (2**bits,), x.device)
    _tensor(scale, "scale", torch.float32, (experts,), x.device)
    rows = x.shape[0]
    if x_rows is not None:
        _rank(x_rows, "x_rows", 1, "1-D")
        _tensor(x_rows, "x_rows", torch.int32, None, x.device)
        rows = x_rows.shape[0]
        if rows and not x.shape[0]:
            raise ValueError("kbit: x has no rows for x_rows to select")
    if row_weights is not None:
        if silu_gate:
            raise ValueError("kbit: row_weights apply to the plain epilogue, not silu_gate")
        _tensor(row_weights, "row_weights", torch.float32, (rows,), x.device)
    if silu_gate and out_features % (2 * GATE_UP_GROUP):
        raise ValueError(f"kbit: silu_gate needs out_features (gate and up rows) a multiple of {2 * GATE_UP_GROUP}, "
                         f"got {out_features}")
    _rank(passes, "passes", 2, "[max_passes, 4]")
    _tensor(passes, "passes", torch.int32, (passes.shape[0], 4), x.device)
    _tensor(num_passes, "num_passes", torch.int32, (1,), x.device)


def moe_combine(y: Tensor, position: Tensor) -> None:
    _rank(y, "y", 2, "2-D [rows, columns]")
    check_dtype(y.dtype, "kbit: y", GEMM_DTYPES)
    _tensor(y, "y", y.dtype, None, y.device)
    if y.shape[1] % X_ALIGN:
        raise ValueError(f"kbit: y must have a multiple of {X_ALIGN} columns, got {y.shape[1]}")
    _rank(position, "position", 2, "[tokens, top_k]")
    _tensor(position, "position", torch.int32, None, y.device)
