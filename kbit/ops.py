"""The ``torch.library`` custom ops of kbit.

Each op has one default implementation (the pure-PyTorch reference, which runs on any device),
a CUDA kernel that calls the JIT-built extension (``kbit._build``), for quantize, dequantize, matmul_stored,
unrepack and gemm (unrepack, then matmul_stored's kernel) a CPU kernel (``kbit._build_cpu``; the reference where it
cannot be built), and a fake
implementation for ``torch.compile``. The ops never synchronize with the host. Their contract -- dtypes, shapes,
sizes -- is checked by the CUDA binding in C++ and, for every other implementation, by ``kbit._op_contract`` (no
values read); the public functions (``kbit._validate``) check their own arguments, values included, before calling
them.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode

from . import _op_contract, formats, grouped, layout, planner
from ._build import cuda_ext
from ._build_cpu import cpu_ext


# ----------------------------------------------------------------------------- quantize
@torch.library.custom_op("kbit::quantize", mutates_args=())
def quantize(A: Tensor, codebook: Tensor, bits: int, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Flatten A, quantize it in blocks of 32: (packed int32 [blocks * bits], absmax uint8 [blocks])."""
    _op_contract.quantize(A, codebook, bits, scale)
    return formats.quantize_reference(A, codebook, bits, scale)


@quantize.register_fake
def _(A, codebook, bits, scale):
    blocks = formats.block_count(A.numel())
    return A.new_empty(blocks * bits, dtype=torch.int32), A.new_empty(blocks, dtype=torch.uint8)


@quantize.register_kernel("cuda")
def _(A, codebook, bits, scale):
    return cuda_ext().quantize(A.contiguous(), codebook, bits, scale)


@quantize.register_kernel("cpu")
def _(A, codebook, bits, scale):
    _op_contract.quantize(A, codebook, bits, scale)
    ext = cpu_ext()
    if ext is None:
        return formats.quantize_reference(A, codebook, bits, scale)
    return ext.quantize(A, codebook, bits, scale)


# ----------------------------------------------------------------------------- dequantize
@torch.library.custom_op("kbit::dequantize", mutates_args=())
def dequantize(
    packed: Tensor, absmax: Tensor, codebook: Tensor, bits: int, n: int, dtype: torch.dtype, scale: Tensor
) -> Tensor:
    """Storage format -> flat tensor of n elements in dtype."""
    _op_contract.dequantize(packed, absmax, codebook, bits, n, dtype, scale)
    return formats.dequantize_reference(packed, absmax, codebook, bits, n, dtype, scale)


@dequantize.register_fake
def _(packed, absmax, codebook, bits, n, dtype, scale):
    return packed.new_empty(n, dtype=dtype)


@dequantize.register_kernel("cuda")
def _(packed, absmax, codebook, bits, n, dtype, scale):
    return cuda_ext().dequantize(packed, absmax, codebook, bits, n, dtype, scale)


@dequantize.register_kernel("cpu")
def _(packed, absmax, codebook, bits, n, dtype, scale):
    _op_contract.dequantize(packed, absmax, codebook, bits, n, dtype, scale)
    ext = cpu_ext()
    if ext is None:
        return formats.dequantize_reference(packed, absmax, codebook, bits, n, dtype, scale)
    return ext.dequantize(packed.contiguous(), absmax.contiguous(), codebook, bits, n, dtype, scale)


def dense_stored(packed, absmax, codebook, bits, out_features, in_features_padded, dtype, scale):
    """The storage format's [out_features, in_features_padded] weight in dtype (``dequantize``, reshaped)."""
    return dequantize(packed, absmax, codebook, bits, out_features * in_features_padded, dtype,
                      scale).reshape(out_features, in_features_padded)


# ----------------------------------------------------------------------------- GEMM from the storage format
def matmul_stored_reference(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded):
    """The reference of ``matmul_stored``: the weight dequantized in float32, multiplied in float32."""
    w = formats.dequantize_reference(packed, absmax, codebook, bits, out_features * in_features_padded,
                                     torch.float32, scale)
    y = x.to(torch.float32) @ w.reshape(out_features, in_features_padded)[:, : x.shape[1]].T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


@torch.library.custom_op("kbit::matmul_stored", mutates_args=())
def matmul_stored(x: Tensor, packed: Tensor, absmax: Tensor, codebook: Tensor, scale: Tensor, bias: Optional[Tensor],
                  bits: int, out_features: int, in_features_padded: int) -> Tensor:
    """y[M, N] = x[M, in_features] @ W_hat[N, :in_features]^T (+ bias) with W_hat read from the storage format
    (no GEMM layout), fp32 accumulation, y in x's dtype: kbit.matmul off CUDA (CPU kernel or the reference)."""
    _op_contract.matmul_stored(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded)
    return matmul_stored_reference(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded)


@matmul_stored.register_fake
def _(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded):
    return x.new_empty(x.shape[0], out_features)


@matmul_stored.register_kernel("cpu")
def _matmul_stored_cpu_op(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded):
    _op_contract.matmul_stored(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded)
    return _matmul_stored_cpu(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded)


def _matmul_stored_cpu(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded):
    """The CPU kernel, or the reference where it cannot be built; arguments checked by the caller."""
    kernel = stored_cpu_kernel(packed, absmax, codebook, scale, bits, out_features, in_features_padded)
    if kernel is None:
        return matmul_stored_reference(x, packed, absmax, codebook, scale, bias, bits, out_features,
                                       in_features_padded)
    return kernel(x, bias)


def stored_cpu_kernel(packed, absmax, codebook, scale, bits, out_features, in_features_padded):
    """The CPU kernel of ``matmul_stored`` with the weight's arguments bound: a function (x, bias) -> y, or None
    where the kernels cannot be built. Unchecked: callers check the arguments with ``_op_contract`` first."""
    ext = cpu_ext()
    if ext is None:
        return None
    packed, absmax = packed.contiguous(), absmax.contiguous()
    return lambda x, bias: ext.gemm(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded)


# Gradients for x and bias (the quantized weight is constant), so that kbit.matmul can sit inside a graph that
# autograd records (torch.compile outside no_grad, adapters trained on top of it). Both GEMM ops take
# (x, weight codes, weight scales, codebook, scale, bias, bits, out_features, in_features_padded, ...); ``dense``
# dequantizes their weight tensors (dequantize_rows).
def _register_gemm_autograd(op, dense) -> None:
    def setup_context(ctx, inputs, output):
        x, codes, block_scales, codebook, scale, bias, bits, out_features, in_features_padded = inputs[:9]
        ctx.save_for_backward(codes, block_scales, codebook, scale)
        ctx.dims = (bits, out_features, in_features_padded, x.shape[1], x.dtype, None if bias is None else bias.dtype)
        ctx.other_inputs = len(inputs) - 9

    def backward(ctx, grad):
        codes, block_scales, codebook, scale = ctx.saved_tensors
        bits, N, K, x_columns, x_dtype, bias_dtype = ctx.dims
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = dequantize_rows(dense, codes, block_scales, codebook, bits, N, K, scale)
            grad_x = (grad.to(torch.float32) @ w[:, :x_columns]).to(x_dtype)
        if bias_dtype is not None and ctx.needs_input_grad[5]:
            grad_bias = grad.to(torch.float32).sum(0).to(bias_dtype)
        return (grad_x, None, None, None, None, grad_bias, None, None, None) + (None,) * ctx.other_inputs

    op.register_autograd(backward, setup_context=setup_context)


_register_gemm_autograd(matmul_stored, dense_stored)


# ----------------------------------------------------------------------------- repack
@torch.library.custom_op("kbit::repack", mutates_args=())
def repack(packed: Tensor, absmax: Tensor, bits: int, out_features: int,
           in_features_padded: int) -> tuple[Tensor, Tensor]:
    """Storage format of an [out_features, in_features_padded] weight -> GEMM layout (see kbit.layout)."""
    _op_contract.repack(packed, absmax, bits, out_features, in_features_padded)
    return layout.repack_reference(packed, absmax, bits, out_features, in_features_padded)


@repack.register_fake
def _(packed, absmax, bits, out_features, in_features_padded):
    b_shape, a_shape = layout.gemm_shapes(bits, out_features, in_features_padded)
    return packed.new_empty(b_shape, dtype=torch.int32), absmax.new_empty(a_shape, dtype=torch.uint8)


@repack.register_kernel("cuda")
def _(packed, absmax, bits, out_features, in_features_padded):
    return cuda_ext().repack(packed, absmax, bits, out_features, in_features_padded)


@torch.library.custom_op("kbit::unrepack", mutates_args=())
def unrepack(b_gemm: Tensor, absmax_gemm: Tensor, bits: int, out_features: int,
             in_features_padded: int) -> tuple[Tensor, Tensor]:
    """GEMM layout -> storage format (the inverse of repack), on any device."""
    _op_contract.unrepack(b_gemm, absmax_gemm, bits, out_features, in_features_padded)
    return layout.unrepack_reference(b_gemm, absmax_gemm, bits, out_features, in_features_padded)


@unrepack.register_fake
def _(b_gemm, absmax_gemm, bits, out_features, in_features_padded):
    blocks = out_features * in_features_padded // formats.BLOCK_SIZE
    return b_gemm.new_empty(blocks * bits, dtype=torch.int32), absmax_gemm.new_empty(blocks, dtype=torch.uint8)


@unrepack.register_kernel("cpu")
def _(b_gemm, absmax_gemm, bits, out_features, in_features_padded):
    _op_contract.unrepack(b_gemm, absmax_gemm, bits, out_features, in_features_padded)
    ext = cpu_ext()
    if ext is None:
        return layout.unrepack_reference(b_gemm, absmax_gemm, bits, out_features, in_features_padded)
    return ext.unrepack(b_gemm, absmax_gemm, bits, out_features, in_features_padded)


@unrepack.register_kernel("cuda")
def _(b_gemm, absmax_gemm, bits, out_features, in_features_padded):
    return cuda_ext().unrepack(b_gemm, absmax_gemm, bits, out_features, in_features_padded)


# ----------------------------------------------------------------------------- dense weight from the GEMM layout
def dequantize_layout_reference(b_gemm, absmax_gemm, codebook, bits, out_features, in_features_padded, dtype, scale):
    """The reference of ``dequantize_layout``: the storage's dequantize reference of the unrepacked layout."""
    packed, absmax = layout.unrepack_reference(b_gemm, absmax_gemm, bits, out_features, in_features_padded)
    return formats.dequantize_reference(packed, absmax, codebook, bits, out_features * in_features_padded, dtype,
                                        scale).reshape(out_features, in_features_padded)


@torch.library.custom_op("kbit::dequantize_layout", mutates_args=())
def dequantize_layout(b_gemm: Tensor, absmax_gemm: Tensor, codebook: Tensor, bits: int, out_features: int,
                      in_features_padded: int, dtype: torch.dtype, scale: Tensor) -> Tensor:
    """GEMM layout -> the dense [out_features, in_features_padded] weight in dtype: ``dequantize`` of the storage
    that ``unrepack`` derives, value for value; on CUDA one pass, no storage in between."""
    _op_contract.dequantize_layout(b_gemm, absmax_gemm, codebook, bits, out_features, in_features_padded, dtype, scale)
    return dequantize_layout_reference(b_gemm, absmax_gemm, codebook, bits, out_features, in_features_padded, dtype,
                                       scale)


@dequantize_layout.register_fake
def _(b_gemm, absmax_gemm, codebook, bits, out_features, in_features_padded, dtype, scale):
    return b_gemm.new_empty((out_features, in_features_padded), dtype=dtype)


@dequantize_layout.register_kernel("cuda")
def _(b_gemm, absmax_gemm, codebook, bits, out_features, in_features_padded, dtype, scale):
    return cuda_ext().dequantize_layout(b_gemm, absmax_gemm, codebook, bits, out_features, in_features_padded, dtype,
                                        scale)


@dequantize_layout.register_kernel("cpu")
def _(b_gemm, absmax_gemm, codebook, bits, out_features, in_features_padded, dtype, scale):
    _op_contract.dequantize_layout(b_gemm, absmax_gemm, codebook, bits, out_features, in_features_padded, dtype, scale)
    packed, absmax = unrepack(b_gemm, absmax_gemm, bits, out_features, in_features_padded)
    return dense_stored(packed, absmax, codebook, bits, out_features, in_features_padded, dtype, scale)


# ----------------------------------------------------------------------------- settled weights
EARLY_WEIGHTS_ENV = "KBIT_EARLY_WEIGHTS"
_SEEN = "_kbit_gemm_seen"  # the (version, address) at which a GEMM last read a tensor


def weights_settled(*tensors: Tensor) -> bool:
    """Whether a GEMM may read these weight tensors before the previous kernel of the stream has finished.

    Launched with programmatic dependent launch (sm_90), the fused GEMM starts while the kernel before it drains and,
    if this returns True, fetches its weights and codebook then, before waiting for that kernel. That is safe for
    a tensor that an earlier GEMM has already read at its current version and address: a write since then
    (``copy_``, ``load_state_dict``, a new ``.data``) changes one of them, and a tensor the kernel just before this
    one wrote is either new, or was written since that read. So the first call after a weight is made or changed
    waits, and marks it for the next. Inference tensors, which keep no version, always wait, and so does every call
    with ``KBIT_EARLY_WEIGHTS=0`` (for weights written behind torch's back, through raw pointers).
    """
    if os.environ.get(EARLY_WEIGHTS_ENV, "1") == "0":
        return False
    settled = True
    for t in tensors:
        try:
            now = (t._version, t.data_ptr())
        except RuntimeError:  # an inference tensor: no version counter
            return False
        if getattr(t, _SEEN, None) != now:
            setattr(t, _SEEN, now)
            settled = False
    return settled


# ----------------------------------------------------------------------------- fused GEMM
def dequantize_rows(dense, codes: Tensor, block_scales: Tensor, codebook: Tensor, bits: int, N: int, K: int,
                    scale: Tensor) -> Tensor:
    """The [N, K] weight in float32 with a per-tensor ``scale`` or one per 256 rows (``layout.row_blocks``: fused
    projections, each row times its own projection's power of two, the same product as that projection's per-tensor
    scale). ``dense``: the weight's dequantizer, (codes, block_scales, codebook, bits, N, K, dtype, scale) -> [N, K]
    (``dequantize_layout`` for the GEMM layout, ``dense_stored`` for the storage format, or a reference)."""
    if scale.numel() == 1:
        return dense(codes, block_scales, codebook, bits, N, K, torch.float32, scale)
    unit = torch.ones((), dtype=torch.float32, device=scale.device)
    w = dense(codes, block_scales, codebook, bits, N, K, torch.float32, unit)
    return w * scale.repeat_interleave(layout.N_ALIGN)[:N, None]


@torch.library.custom_op("kbit::gemm", mutates_args=())
def gemm(
    x: Tensor,
    b_gemm: Tensor,
    absmax_gemm: Tensor,
    codebook: Tensor,
    scale: Tensor,
    bias: Optional[Tensor],
    bits: int,
    out_features: int,
    in_features_padded: int,
    grid_override: int,
) -> Tensor:
    """y[M, N] = x[M, K_pad] @ W_hat[N, K_pad]^T (+ bias), fp32 accumulation, y in x's dtype; x may have fewer
    columns (the rest read as zeros). ``scale``: the per-tensor scale, or one per 256 output rows
    [``layout.row_blocks(N)``] (sibling projections fused into one launch, each padded to 256 rows: ``kbit.fusion``),
    applied where the per-tensor one is.

    ``grid_override`` > 0 forces the CUDA kernel's grid size (to force split-K in tests), at most one CTA per SM
    (CTAs of a split tile wait for each other, so all must be resident); 0 = auto.
    """
    _op_contract.gemm(x, b_gemm, absmax_gemm, codebook, scale, bias, bits, out_features, in_features_padded)
    N, K = out_features, in_features_padded
    w = dequantize_rows(dequantize_layout_reference, b_gemm, absmax_gemm, codebook, bits, N, K, scale)
    y = x.to(torch.float32) @ w[:, : x.shape[1]].T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


@gemm.register_fake
def _(x, b_gemm, absmax_gemm, codebook, scale, bias, bits, out_features, in_features_padded, grid_override):
    return x.new_empty(x.shape[0], out_features)


@gemm.register_kernel("cuda")
def _gemm_cuda(x, b_gemm, absmax_gemm, codebook, scale, bias, bits, out_features, in_features_padded, grid_override):
    chosen = planner.gemm_plan(x.device, out_features, in_features_padded, x.shape[0], bits, fused_only=True,
                               grid_override=grid_override)
    return cuda_ext().gemm(x, b_gemm, absmax_gemm, codebook, scale, bias, bits, out_features, in_features_padded,
                           chosen.grid, chosen.tile_parts, chosen.whole_tiles, chosen.mb, chosen.wgmma_tiles,
                           chosen.k_split, chosen.ws_tokens, weights_settled(b_gemm, absmax_gemm, codebook))


@gemm.register_kernel("cpu")
def _gemm_cpu(x, b_gemm, absmax_gemm, codebook, scale, bias, bits, out_features, in_features_padded, grid_override):
    # The CPU kernels read the storage format: the layout goes back to it on every call (a weight kept on CPU, as
    # QuantizedWeight keeps it, never pays this).
    _op_contract.gemm(x, b_gemm, absmax_gemm, codebook, scale, bias, bits, out_features, in_features_padded)
    packed, absmax = unrepack(b_gemm, absmax_gemm, bits, out_features, in_features_padded)
    if scale.numel() != 1:  # one scale per 256 rows (fused projections): each run of rows with its own scale
        return _gemm_cpu_by_row_scale(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded)
    return _matmul_stored_cpu(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded)


def _gemm_cpu_by_row_scale(x, packed, absmax, codebook, scale, bias, bits, out_features, in_features_padded):
    """``gemm`` on CPU with one scale per 256 rows: the storage rows of each run of blocks that share a scale go
    through ``matmul_stored`` with that scale (the CPU kernel takes one scale per call), their outputs side by side."""
    rows_packed, rows_absmax = packed.view(out_features, -1), absmax.view(out_features, -1)
    parts, start = [], 0
    for value, count in zip(*torch.unique_consecutive(scale, return_counts=True)):
        stop = min(start + int(count) * layout.N_ALIGN, out_features)
        part_bias = None if bias is None else bias[start:stop]
        parts.append(matmul_stored(x, rows_packed[start:stop].reshape(-1), rows_absmax[start:stop].reshape(-1),
                                   codebook, value, part_bias, bits, stop - start, in_features_padded))
        start = stop
    return torch.cat(parts, dim=-1)


_register_gemm_autograd(gemm, dequantize_layout)


# ----------------------------------------------------------------------------- eager calls
def _direct(op, kernels: dict):
    """``op`` as a function that runs its device's registered kernel (``kernels``) itself where neither autograd nor
    a tracer takes part in the call: plain tensors (no subclass such as a fake or distributed tensor), none requiring
    grad, not compiling, no dispatch mode (make_fx, FakeTensorMode) or functorch transform (vmap) active. The op's
    dispatch (the custom op's, autograd's and dynamo's wrappers) costs more host time per call than a small layer's
    GEMM at one token, which an eager decode pays for every projection. Elsewhere the op runs: the same kernel, the
    same result."""
    def call(x, *args):
        if (not torch.compiler.is_compiling() and _dispatch_mode() is None
                and not torch._C._are_functorch_transforms_active() and _plain_without_grad((x, *args))):
            kernel = kernels.get(x.device.type)
            if kernel is not None:
                return kernel(x, *args)
        return op(x, *args)

    call.__doc__ = f"``{op._namespace}::{op._name}``, its kernel called directly where nothing else takes part."
    return call


def _plain_without_grad(args) -> bool:
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, Tensor) and (type(a) is not Tensor and type(a) is not torch.nn.Parameter
                                      or grad and a.requires_grad):
            return False
    return True


GEMM_KERNELS = {"cpu": _gemm_cpu, "cuda": _gemm_cuda}  # the kernels registered above, by device type
MATMUL_STORED_KERNELS = {"cpu": _matmul_stored_cpu_op}
gemm_direct = _direct(gemm, GEMM_KERNELS)
matmul_stored_direct = _direct(matmul_stored, MATMUL_STORED_KERNELS)


# ----------------------------------------------------------------------------- mixture of experts (kbit.grouped)
@torch.library.custom_op("kbit::moe_route", mutates_args=())
def moe_route(
    expert_ids: Tensor, weights: Tensor, num_experts: int, rows_per_pass: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A MoE layer's (token, choice) slots sorted by expert into token passes: (x_rows, row_weights, position,
    passes, num_passes), as ``kbit.grouped`` documents them."""
    _op_contract.moe_route(expert_ids, weights, num_experts, rows_per_pass)
    return grouped.route_reference(expert_ids, weights, num_experts, rows_per_pass)


@moe_route.register_fake
def _(expert_ids, weights, num_experts, rows_per_pass):
    T, top_k = expert_ids.shape
    S = T * top_k
    P = grouped.max_passes(num_experts, S, rows_per_pass)
    i32 = torch.int32
    return (expert_ids.new_empty(S, dtype=i32), expert_ids.new_empty(S, dtype=torch.float32),
            expert_ids.new_empty(T, top_k, dtype=i32), expert_ids.new_empty(P, 4, dtype=i32),
            expert_ids.new_empty(1, dtype=i32))


@moe_route.register_kernel("cuda")
def _moe_route_cuda(expert_ids, weights, num_experts, rows_per_pass):
    return cuda_ext().moe_route(expert_ids, weights, num_experts, rows_per_pass)


@torch.library.custom_op("kbit::moe_gemm", mutates_args=())
def moe_gemm(
    x: Tensor,
    b_gemm: Tensor,
    absmax_gemm: Tensor,
    codebook: Tensor,
    scale: Tensor,
    x_rows: Optional[Tensor],
    row_weights: Optional[Tensor],
    passes: Tensor,
    num_passes: Tensor,
    bits: int,
    out_features: int,
    in_features_padded: int,
    rows_per_pass: int,
    silu_gate: bool,
    grid_override: int,
) -> Tensor:
    """Every token pass of a MoE layer against its expert's weight (the experts' GEMM layouts stacked), in one
    launch on CUDA: y[i] = x[x_rows[i]] @ W_hat[e].T * row_weights[i]; with ``silu_gate``, silu(gate) * up of
    interleaved gate/up rows (``kbit.grouped``). ``grid_override`` > 0 forces the CUDA grid (tests force split-K)."""
    _op_contract.moe_gemm(x, b_gemm, absmax_gemm, codebook, scale, x_rows, row_weights, passes, num_passes, bits,
                          out_features, in_features_padded, rows_per_pass, silu_gate, grid_override)
    return grouped.moe_gemm_reference(x, b_gemm, absmax_gemm, codebook, scale, x_rows, row_weights, passes,
                                      num_passes, bits, out_features, in_features_padded, silu_gate)


@moe_gemm.register_fake
def _(x, b_gemm, absmax_gemm, codebook, scale, x_rows, row_weights, passes, num_passes, bits, out_features,
      in_features_padded, rows_per_pass, silu_gate, grid_override):
    rows = x_rows.shape[0] if x_rows is not None else x.shape[0]
    return x.new_empty(rows, out_features // 2 if silu_gate else out_features)


@moe_gemm.register_kernel("cuda")
def _moe_gemm_cuda(x, b_gemm, absmax_gemm, codebook, scale, x_rows, row_weights, passes, num_passes, bits, out_features,
                   in_features_padded, rows_per_pass, silu_gate, grid_override):
    return cuda_ext().moe_gemm(x, b_gemm, absmax_gemm, codebook, scale, x_rows, row_weights, passes, num_passes, bits,
                               out_features, in_features_padded, rows_per_pass, silu_gate, grid_override,
                               weights_settled(b_gemm, absmax_gemm, codebook))


@torch.library.custom_op("kbit::moe_combine", mutates_args=())
def moe_combine(y: Tensor, position: Tensor) -> Tensor:
    """out[t] = sum_j y[position[t, j]] (fp32, j ascending, -1 skipped), in y's dtype."""
    _op_contract.moe_combine(y, position)
    return grouped.combine_reference(y, position)


@moe_combine.register_fake
def _(y, position):
    return y.new_empty(position.shape[0], y.shape[1])


@moe_combine.register_kernel("cuda")
def _moe_combine_cuda(y, position):
    return cuda_ext().moe_combine(y, position)


# The MoE ops as an eager decode calls them (``_direct``): four a layer, each costing more host time through the
# op's dispatch than a decode step's routing or combine on the GPU.
moe_route_direct = _direct(moe_route, {"cuda": _moe_route_cuda})
moe_gemm_direct = _direct(moe_gemm, {"cuda": _moe_gemm_cuda})
moe_combine_direct = _direct(moe_combine, {"cuda": _moe_combine_cuda})
