"""The grouped (mixture-of-experts) GEMM in pure PyTorch: routing tables, the grouped product, the combine.

A MoE layer sends each of T tokens to ``top_k`` of E experts. kbit runs the routed experts of a layer in three
ops (``kbit.ops.moe_route``, ``moe_gemm``, ``moe_combine``), each a CUDA kernel with its reference here, so
that one launch computes every expert's tokens and nothing waits for the host (CUDA graphs capture it whole).

``moe_route(expert_ids [T, top_k], weights [T, top_k], E, R)`` sorts the S = T * top_k slots (token t, choice
j) by expert and cuts each expert's rows into passes of at most R rows, one GEMM token pass each:

    x_rows       int32 [S]        token (row of the layer's input) of sorted row i; 0 past the routed rows
    row_weights  float32 [S]      routing weight of sorted row i; 0 past the routed rows
    position     int32 [T, top_k] sorted row of slot (t, j); -1 when its expert id is outside [0, E)
                                  (not routed: expert parallelism marks foreign experts so)
    passes       int32 [P, 4]     P = min(E, S) + S // R, an upper bound whatever the routing; pass p is
                                  (expert, first sorted row, rows, 0), experts ascending, 1 <= rows <= R;
                                  entries from num_passes on are 0
    num_passes   int32 [1]

The reference orders an expert's rows by slot; the CUDA kernel may order them differently (a row's result
never depends on where it sits, so outputs do not change).

``moe_gemm`` multiplies every pass's rows by its expert's weight (the GEMM layout of ``kbit.layout``, one per
expert, stacked): ``y[i] = x[x_rows[i]] @ W_hat[e].T * row_weights[i]``, fp32 accumulation, y in x's dtype
(``x_rows`` None: row i of x; ``row_weights`` None: 1). Rows no pass covers are left unwritten. With
``silu_gate`` the expert weights are gate/up projections whose rows are interleaved by 8 (``interleave_gate_up``),
and y holds ``silu(gate) * up`` (N / 2 columns), computed in fp32 and rounded once.

``moe_combine(y [S, N], position [T, top_k])`` -> [T, N]: ``out[t] = sum_j y[position[t, j]]`` in fp32 in j
order, skipping -1, rounded once to y's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import formats, layout

GATE_UP_GROUP = 8  # gate and up rows alternate in groups of 8: rows g and g + 8 of one 16-row MMA tile


def max_passes(num_experts: int, slots: int, rows_per_pass: int) -> int:
    """Passes of at most ``rows_per_pass`` rows that ``slots`` rows over ``num_experts`` experts can need.

    ceil(c / R) <= c // R + 1 for each of the at most min(E, S) experts with rows, and the c // R sum to at
    most S // R.
    """
    return min(num_experts, slots) + slots // rows_per_pass


def gate_up_row_order(intermediate: int, device=None) -> Tensor:
    """Row order of the interleaved gate/up weight: rows 16t .. 16t + 7 are gate rows 8t .. 8t + 7 and rows
    16t + 8 .. 16t + 15 the up rows 8t .. 8t + 7 (row ``intermediate + r`` of the [2I, H] weight is up row r)."""
    gate = torch.arange(intermediate, device=device).view(-1, GATE_UP_GROUP)
    return torch.stack([gate, gate + intermediate], dim=1).reshape(-1)


def interleave_gate_up(rows: Tensor, intermediate: int) -> Tensor:
    """Rows of a [2I, ...] gate/up tensor (or its storage viewed per row) in the interleaved order."""
    return rows[gate_up_row_order(intermediate, rows.device)]


def route_reference(expert_ids: Tensor, weights: Tensor, num_experts: int, rows_per_pass: int):
    """Reference of ``moe_route``: (x_rows, row_weights, position, passes, num_passes)."""
    T, top_k = expert_ids.shape
    S, dev = T * top_k, expert_ids.device
    ids = expert_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    key = torch.where(valid, ids, num_experts)  # the unrouted sort last
    order = torch.sort(key, stable=True).indices
    routed = int(valid.sum())
    x_rows = torch.zeros(S, dtype=torch.int32, device=dev)
    row_weights = torch.zeros(S, dtype=torch.float32, device=dev)
    x_rows[:routed] = (order[:routed] // top_k).to(torch.int32)
    row_weights[:routed] = weights.reshape(-1).to(torch.float32)[order[:routed]]
    position = torch.full((S,), -1, dtype=torch.int32, device=dev)
    position[order[:routed]] = torch.arange(routed, dtype=torch.int32, device=dev)

    counts = torch.bincount(key[valid], minlength=num_experts)
    row_start = torch.cumsum(counts, 0) - counts
    per_expert = (counts + rows_per_pass - 1) // rows_per_pass
    expert = torch.repeat_interleave(torch.arange(num_experts, device=dev), per_expert)  # of each pass
    nth = torch.arange(expert.numel(), device=dev) - (torch.cumsum(per_expert, 0) - per_expert)[expert]
    first = row_start[expert] + nth * rows_per_pass
    rows = torch.clamp(counts[expert] - nth * rows_per_pass, max=rows_per_pass)
    passes = torch.zeros(max_passes(num_experts, S, rows_per_pass), 4, dtype=torch.int32, device=dev)
    passes[: expert.numel(), :3] = torch.stack([expert, first, rows], dim=1).to(torch.int32)
    num_passes = torch.tensor([expert.numel()], dtype=torch.int32, device=dev)
    return x_rows, row_weights, position.view(T, top_k), passes, num_passes


def expert_weight_reference(b_gemm: Tensor, absmax_gemm: Tensor, codebook: Tensor, scale: Tensor, bits: int,
                            out_features: int, in_features_padded: int) -> Tensor:
    """The float32 [out_features, in_features_padded] weight of one expert from its GEMM layout (``kbit.layout``)."""
    N, K = out_features, in_features_padded
    packed, absmax = layout.unrepack_reference(b_gemm, absmax_gemm, bits, N, K)
    w = formats.dequantize_reference(packed, absmax, codebook, bits, N * K, torch.float32, scale)
    return w.reshape(N, K)


def moe_gemm_reference(x: Tensor, b_gemm: Tensor, absmax_gemm: Tensor, codebook: Tensor, scale: Tensor,
                       x_rows: Optional[Tensor], row_weights: Optional[Tensor], passes: Tensor, num_passes: Tensor,
                       bits: int, out_features: int, in_features_padded: int, silu_gate: bool) -> Tensor:
    """Reference of ``moe_gemm``; rows no pass covers are 0."""
    S = x_rows.numel() if x_rows is not None else x.shape[0]
    N = out_features
    y = torch.zeros(S, N // 2 if silu_gate else N, dtype=torch.float32, device=x.device)
    weights = {}
    for e, first, rows, _ in passes[: int(num_passes[0])].tolist():
        if e not in weights:
            weights[e] = expert_weight_reference(b_gemm[e], absmax_gemm[e], codebook, scale[e], bits, N,
                                                 in_features_padded)
        sel = torch.arange(first, first + rows, device=x.device)
        src = x_rows[sel].long() if x_rows is not None else sel
        out = x[src].to(torch.float32) @ weights[e][:, : x.shape[1]].T
        if silu_gate:
            pairs = out.view(rows, -1, 2, GATE_UP_GROUP)
            out = (torch.nn.functional.silu(pairs[:, :, 0]) * pairs[:, :, 1]).reshape(rows, -1)
        if row_weights is not None:
            out = out * row_weights[sel, None]
        y[sel] = out
    return y.to(x.dtype)


def combine_reference(y: Tensor, position: Tensor) -> Tensor:
    """Reference of ``moe_combine``: out[t] = sum_j y[position[t, j]] (fp32, j order, -1 skipped)."""
    T, top_k = position.shape
    out = torch.zeros(T, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(top_k):
        pos = position[:, j].long()
        out += torch.where((pos >= 0)[:, None], y[pos.clamp(min=0)].to(torch.float32), 0.0)
    return out.to(y.dtype)
