// kbit CUDA core, mixture of experts: the host-side interface of the routing kernels and the grouped GEMM
// (kbit/grouped.py documents every table and the reference of each op). Framework-free, like kbit.h.
#pragma once

#include "kbit.h"

namespace kbit {

// Experts per layer the routing kernel sorts in one CTA's shared memory (kbit/moe.py MAX_GROUPED_EXPERTS).
constexpr int kMaxGroupedExperts = 1024;

// ---------------------------------------------------------------------------- routing
// expert_ids, weights: [slots] (token t's choice j at t * top_k + j), ids int32 or int64 (ids_64), weights in
// weights_dtype. Writes x_rows, row_weights, position [slots], passes [max_passes] (expert, first row, rows, 0;
// zeros from num_passes on) and num_passes [1]; max_passes = min(num_experts, slots) + slots / rows_per_pass.
// One CTA: a counting sort in shared memory (an expert's rows in any order).
cudaError_t moe_route(const void* expert_ids, bool ids_64, const void* weights, DType weights_dtype, int slots,
                      int top_k, int num_experts, int rows_per_pass, int max_passes, int* x_rows, float* row_weights,
                      int* position, int4* passes, int* num_passes, cudaStream_t stream);

// out[t, :] = sum_j y[position[t * top_k + j], :] in fp32 (j ascending; positions outside [0, rows_y) skipped).
// y [rows_y, n] and out [tokens, n] in dtype, n a multiple of 8, both 16-byte aligned.
cudaError_t moe_combine(const void* y, int rows_y, const int* position, int tokens, int top_k, int n, void* out,
                        DType dtype, cudaStream_t stream);

// ---------------------------------------------------------------------------- grouped GEMM
// The fused GEMM over every expert's token passes in one launch (gemm.cuh, GemmConfig's G): b, absmax and scale
// hold num_experts weights stacked, expert e's GEMM layout at tile16 e * expert_tiles16 (N padded to 256 / 16
// tiles of 16 rows), its scale at scale[e]. Token pass i (the step's pass) is passes[i]: rows first .. first +
// rows - 1 of y, row r reading x row x_rows[r] (r itself when x_rows is null); num_passes is known on the device
// only, so each CTA cuts the step range itself. Every value read from these tables is bounds-checked: a crafted
// table yields wrong numbers, never an access outside x, y or the weights.
enum class GroupedEpilogue : int { Store = 1, SiluGate = 2 };

struct GroupedGemmParams : GemmParams {
  const int4* passes;         // [max_passes]
  const int* num_passes;      // device scalar, clamped to max_passes
  const int* x_rows;          // [M] rows of x, or nullptr
  const float* row_weights;   // [M] each y row multiplied by its weight, or nullptr
  int max_passes, num_experts, expert_tiles16;
  int x_count;                // rows of x (x_rows' values are clamped below it)
  GroupedEpilogue epilogue;   // Store: y[M, N]; SiluGate: rows interleaved by 8 (gate, up), y[M, N / 2] = silu(gate) * up
};

// The token rows per pass the grouped GEMM has configurations for: 8, 16 or 32 (mma.sync) or 128 (wgmma, compute
// capability 9.x); which of them a device runs at k bits, the binding reports (moe_rows_per_pass_supported).
inline constexpr int kGroupedRowsPerPass[] = {8, 16, 32, 128};

// rows_per_pass: one of kGroupedRowsPerPass. grid_override > 0: that many CTAs, at most one per SM (tests force
// split-K with it); else one per SM.
GemmPlan grouped_gemm_plan(int rows_per_pass, int k, int num_sms, int grid_override);
// Fills the plan-derived fields of p (p.k set); p.M is the rows of y.
void grouped_gemm_fill_params(GroupedGemmParams& p, const GemmPlan& plan, int N, int K_w);
cudaError_t grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream);

}  // namespace kbit
