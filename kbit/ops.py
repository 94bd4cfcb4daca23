"""The ``torch.library`` custom ops of kbit.

Each op has one default implementation (the pure-PyTorch reference, which runs on any device),
a CUDA kernel that calls the JIT-built extension (``kbit._build``), and a fake implementation
for ``torch.compile``. The ops do no validation and never synchronize with the host: the public
functions in ``kbit.functional`` and ``kbit.weight`` check arguments before calling them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import formats, grouped, layout
from ._build import cuda_ext


# ----------------------------------------------------------------------------- quantize
@torch.library.custom_op("kbit::quantize", mutates_args=())
def quantize(A: Tensor, codebook: Tensor, k: int, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Flatten A, quantize it in blocks of 32: (packed int32 [nb * k], absmax uint8 [nb])."""
    return formats.quantize_reference(A, codebook, k, scale)


@quantize.register_fake
def _(A, codebook, k, scale):
    nb = formats.num_blocks(A.numel())
    return A.new_empty(nb * k, dtype=torch.int32), A.new_empty(nb, dtype=torch.uint8)


@quantize.register_kernel("cuda")
def _(A, codebook, k, scale):
    return cuda_ext().quantize(A.contiguous(), codebook, k, scale)


# ----------------------------------------------------------------------------- dequantize
@torch.library.custom_op("kbit::dequantize", mutates_args=())
def dequantize(
    packed: Tensor, absmax: Tensor, codebook: Tensor, k: int, n: int, dtype: torch.dtype, scale: Tensor
) -> Tensor:
    """Storage format -> flat tensor of n elements in dtype."""
    return formats.dequantize_reference(packed, absmax, codebook, k, n, dtype, scale)


@dequantize.register_fake
def _(packed, absmax, codebook, k, n, dtype, scale):
    return packed.new_empty(n, dtype=dtype)


@dequantize.register_kernel("cuda")
def _(packed, absmax, codebook, k, n, dtype, scale):
    return cuda_ext().dequantize(packed, absmax, codebook, k, n, dtype, scale)


# ----------------------------------------------------------------------------- repack
@torch.library.custom_op("kbit::repack", mutates_args=())
def repack(packed: Tensor, absmax: Tensor, k: int, N: int, K_dim: int) -> tuple[Tensor, Tensor]:
    """Storage format of an [N, K_dim] weight -> GEMM layout (see kbit.layout)."""
    return layout.repack_reference(packed, absmax, k, N, K_dim)


@repack.register_fake
def _(packed, absmax, k, N, K_dim):
    b_shape, a_shape = layout.gemm_shapes(k, N, K_dim)
    return packed.new_empty(b_shape, dtype=torch.int32), absmax.new_empty(a_shape, dtype=torch.uint8)


@repack.register_kernel("cuda")
def _(packed, absmax, k, N, K_dim):
    return cuda_ext().repack(packed, absmax, k, N, K_dim)


@torch.library.custom_op("kbit::unrepack", mutates_args=())
def unrepack(b_gemm: Tensor, absmax_gemm: Tensor, k: int, N: int, K_dim: int) -> tuple[Tensor, Tensor]:
    """GEMM layout -> storage format (the inverse of repack), on any device."""
    return layout.unrepack_reference(b_gemm, absmax_gemm, k, N, K_dim)


@unrepack.register_fake
def _(b_gemm, absmax_gemm, k, N, K_dim):
    nb = N * K_dim // formats.BLOCK_SIZE
    return b_gemm.new_empty(nb * k, dtype=torch.int32), absmax_gemm.new_empty(nb, dtype=torch.uint8)


# ----------------------------------------------------------------------------- fused GEMM
@torch.library.custom_op("kbit::gemm", mutates_args=())
def gemm(
    x: Tensor,
    b_gemm: Tensor,
    absmax_gemm: Tensor,
    codebook: Tensor,
    scale: Tensor,
    bias: Optional[Tensor],
    k: int,
    N: int,
    K_dim: int,
    num_blocks: int,
) -> Tensor:
    """y[M, N] = x[M, K_dim] @ W_hat[N, K_dim]^T (+ bias), fp32 accumulation, y in x's dtype.

    ``num_blocks`` > 0 forces the CUDA kernel's grid size (to force split-K in tests), at most one CTA per SM
    (CTAs of a split tile wait for each other, so all must be resident); 0 = auto.
    """
    packed, absmax = layout.unrepack_reference(b_gemm, absmax_gemm, k, N, K_dim)
    w = formats.dequantize_reference(packed, absmax, codebook, k, N * K_dim, torch.float32, scale)
    y = x.to(torch.float32) @ w.reshape(N, K_dim)[:, : x.shape[1]].T  # x may have fewer columns (zeros)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


@gemm.register_fake
def _(x, b_gemm, absmax_gemm, codebook, scale, bias, k, N, K_dim, num_blocks):
    return x.new_empty(x.shape[0], N)


@gemm.register_kernel("cuda")
def _(x, b_gemm, absmax_gemm, codebook, scale, bias, k, N, K_dim, num_blocks):
    return cuda_ext().gemm(x, b_gemm, absmax_gemm, codebook, scale, bias, k, N, K_dim, num_blocks)


# Gradients for x and bias (the quantized weight is constant), so that kbit.matmul can sit inside
# a graph that autograd records (torch.compile outside no_grad, adapters trained on top of it).
def _gemm_setup_context(ctx, inputs, output):
    x, b_gemm, absmax_gemm, codebook, scale, bias, k, N, K_dim, num_blocks = inputs
    ctx.save_for_backward(b_gemm, absmax_gemm, codebook, scale)
    ctx.dims = (k, N, K_dim, x.shape[1], x.dtype, None if bias is None else bias.dtype)


def _gemm_backward(ctx, grad):
    b_gemm, absmax_gemm, codebook, scale = ctx.saved_tensors
    k, N, K_dim, K_x, x_dtype, bias_dtype = ctx.dims
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        packed, absmax = unrepack(b_gemm, absmax_gemm, k, N, K_dim)
        w = dequantize(packed, absmax, codebook, k, N * K_dim, torch.float32, scale).reshape(N, K_dim)
        grad_x = (grad.to(torch.float32) @ w[:, :K_x]).to(x_dtype)
    if bias_dtype is not None and ctx.needs_input_grad[5]:
        grad_bias = grad.to(torch.float32).sum(0).to(bias_dtype)
    return grad_x, None, None, None, None, grad_bias, None, None, None, None


gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)


# ----------------------------------------------------------------------------- mixture of experts (kbit.grouped)
@torch.library.custom_op("kbit::moe_route", mutates_args=())
def moe_route(
    expert_ids: Tensor, weights: Tensor, num_experts: int, rows_per_pass: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A MoE layer's (token, choice) slots sorted by expert into token passes: (x_rows, row_weights, position,
    passes, num_passes), as ``kbit.grouped`` documents them."""
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
def _(expert_ids, weights, num_experts, rows_per_pass):
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
    k: int,
    N: int,
    K_dim: int,
    rows_per_pass: int,
    silu_gate: bool,
    num_blocks: int,
) -> Tensor:
    """Every token pass of a MoE layer against its expert's weight (the experts' GEMM layouts stacked), in one
    launch on CUDA: y[i] = x[x_rows[i]] @ W_hat[e].T * row_weights[i]; with ``silu_gate``, silu(gate) * up of
    interleaved gate/up rows (``kbit.grouped``). ``num_blocks`` > 0 forces the CUDA grid (tests force split-K)."""
    return grouped.moe_gemm_reference(x, b_gemm, absmax_gemm, codebook, scale, x_rows, row_weights, passes,
                                      num_passes, k, N, K_dim, silu_gate)


@moe_gemm.register_fake
def _(x, b_gemm, absmax_gemm, codebook, scale, x_rows, row_weights, passes, num_passes, k, N, K_dim, rows_per_pass,
      silu_gate, num_blocks):
    rows = x_rows.shape[0] if x_rows is not None else x.shape[0]
    return x.new_empty(rows, N // 2 if silu_gate else N)


@moe_gemm.register_kernel("cuda")
def _(x, b_gemm, absmax_gemm, codebook, scale, x_rows, row_weights, passes, num_passes, k, N, K_dim, rows_per_pass,
      silu_gate, num_blocks):
    return cuda_ext().moe_gemm(x, b_gemm, absmax_gemm, codebook, scale, x_rows, row_weights, passes, num_passes, k, N,
                               K_dim, rows_per_pass, silu_gate, num_blocks)


@torch.library.custom_op("kbit::moe_combine", mutates_args=())
def moe_combine(y: Tensor, position: Tensor) -> Tensor:
    """out[t] = sum_j y[position[t, j]] (fp32, j ascending, -1 skipped), in y's dtype."""
    return grouped.combine_reference(y, position)


@moe_combine.register_fake
def _(y, position):
    return y.new_empty(position.shape[0], y.shape[1])


@moe_combine.register_kernel("cuda")
def _(y, position):
    return cuda_ext().moe_combine(y, position)
