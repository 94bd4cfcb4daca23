// The routing kernels of a mixture-of-experts layer (moe.h; references in kbit/grouped.py): moe_route sorts the
// layer's (token, choice) slots by expert into the grouped GEMM's token passes, moe_combine sums each token's
// expert outputs.
#include <algorithm>

#include "common.cuh"
#include "moe.h"

namespace kbit {

constexpr int kRouteThreads = 1024;  // one expert per thread in the prefix sums (kMaxGroupedExperts)
static_assert(kMaxGroupedExperts <= kRouteThreads, "the route kernel's scan holds one expert per thread");

// Inclusive prefix sums of (v.x, v.y) over the CTA's threads (kRouteThreads of them, in index order).
__device__ __forceinline__ int2 block_inclusive_scan(int2 v, int2* warp_totals) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int x = __shfl_up_sync(0xFFFFFFFFu, v.x, offset), y = __shfl_up_sync(0xFFFFFFFFu, v.y, offset);
    if (lane >= offset) v.x += x, v.y += y;
  }
  if (lane == 31) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int2 t = warp_totals[lane];
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int x = __shfl_up_sync(0xFFFFFFFFu, t.x, offset), y = __shfl_up_sync(0xFFFFFFFFu, t.y, offset);
      if (lane >= offset) t.x += x, t.y += y;
    }
    warp_totals[lane] = t;
  }
  __syncthreads();
  if (warp > 0) v.x += warp_totals[warp - 1].x, v.y += warp_totals[warp - 1].y;
  return v;
}

// One CTA: count each expert's slots, prefix-sum the counts into each expert's first sorted row and first pass,
// place every slot at its expert's next free row (shared-memory atomics: an expert's rows in arrival order, which
// no result depends on), then write the pass table, each entry found by a binary search over the experts' first
// passes. Ids outside [0, E) are not routed (position -1).
template <typename Id, typename W>
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const Id* ids, const W* weights, int slots,
                                                                 int top_k, int num_experts, int rows_per_pass,
                                                                 int max_passes, int* x_rows, float* row_weights,
                                                                 int* position, int4* passes, int* num_passes) {
  __shared__ int fill[kMaxGroupedExperts];          // slots per expert, then rows placed so far
  __shared__ int row_start[kMaxGroupedExperts + 1];  // an expert's first sorted row; [E]: rows routed
  __shared__ int pass_start[kMaxGroupedExperts + 1];  // an expert's first pass; [E]: passes
  __shared__ int2 warp_totals[32];
  const int tid = threadIdx.x, E = num_experts, R = rows_per_pass;
  auto expert_of = [&](int i) {
    const int64_t e = static_cast<int64_t>(ids[i]);
    return e >= 0 && e < E ? static_cast<int>(e) : -1;
  };
  for (int e = tid; e < E; e += kRouteThreads) fill[e] = 0;
  __syncthreads();
  for (int i = tid; i < slots; i += kRouteThreads) {
    const int e = expert_of(i);
    if (e >= 0) atomicAdd(&fill[e], 1);
  }
  __syncthreads();
  const int count = tid < E ? fill[tid] : 0, count_passes = (count + R - 1) / R;
  const int2 ends = block_inclusive_scan(make_int2(count, count_passes), warp_totals);
  if (tid < E) {
    row_start[tid] = ends.x - count, pass_start[tid] = ends.y - count_passes;
    fill[tid] = 0;
  }
  if (tid == E - 1) row_start[E] = ends.x, pass_start[E] = ends.y;
  __syncthreads();

  for (int i = tid; i < slots; i += kRouteThreads) {
    const int e = expert_of(i);
    int row = -1;
    if (e >= 0) {
      row = row_start[e] + atomicAdd(&fill[e], 1);
      x_rows[row] = i / top_k;
      row_weights[row] = to_float(weights[i]);
    }
    position[i] = row;
  }
  for (int row = row_start[E] + tid; row < slots; row += kRouteThreads) x_rows[row] = 0, row_weights[row] = 0.0f;
  const int total = pass_start[E];
  for (int p = tid; p < max_passes; p += kRouteThreads) {
    int4 entry = make_int4(0, 0, 0, 0);
    if (p < total) {
      int lo = 0, hi = E;  // pass_start[lo] <= p < pass_start[hi]: ends at the expert that owns pass p
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        (pass_start[mid] <= p ? lo : hi) = mid;
      }
      const int first = row_start[lo] + (p - pass_start[lo]) * R;
      entry = make_int4(lo, first, min(R, row_start[lo + 1] - first), 0);
    }
    passes[p] = entry;
  }
  if (tid == 0) *num_passes = total;
}

template <typename Id>
cudaError_t launch_route(const Id* ids, const void* weights, DType weights_dtype, int slots, int top_k, int E, int R,
                         int max_passes, int* x_rows, float* row_weights, int* position, int4* passes,
                         int* num_passes, cudaStream_t stream) {
  const dim3 grid(1), block(kRouteThreads);
  switch (weights_dtype) {
    case DType::F32:
      moe_route_kernel<<<grid, block, 0, stream>>>(ids, static_cast<const float*>(weights), slots, top_k, E, R,
                                                   max_passes, x_rows, row_weights, position, passes, num_passes);
      break;
    case DType::F16:
      moe_route_kernel<<<grid, block, 0, stream>>>(ids, static_cast<const __half*>(weights), slots, top_k, E, R,
                                                   max_passes, x_rows, row_weights, position, passes, num_passes);
      break;
    case DType::BF16:
      moe_route_kernel<<<grid, block, 0, stream>>>(ids, static_cast<const __nv_bfloat16*>(weights), slots, top_k, E,
                                                   R, max_passes, x_rows, row_weights, position, passes, num_passes);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t moe_route(const void* expert_ids, bool ids_64, const void* weights, DType weights_dtype, int slots,
                      int top_k, int num_experts, int rows_per_pass, int max_passes, int* x_rows, float* row_weights,
                      int* position, int4* passes, int* num_passes, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMaxGroupedExperts || rows_per_pass < 1 || top_k < 1) return cudaErrorInvalidValue;
  if (ids_64)
    return launch_route(static_cast<const int64_t*>(expert_ids), weights, weights_dtype, slots, top_k, num_experts,
                        rows_per_pass, max_passes, x_rows, row_weights, position, passes, num_passes, stream);
  return launch_route(static_cast<const int32_t*>(expert_ids), weights, weights_dtype, slots, top_k, num_experts,
                      rows_per_pass, max_passes, x_rows, row_weights, position, passes, num_passes, stream);
}

// ---------------------------------------------------------------------------- combine
constexpr int kCombineThreads = 128;  // 8 columns (16 bytes) each: 1024 columns per CTA

// CTA (t, b): columns 1024 b .. of token t. Each thread adds its 8 columns of the token's top_k rows in fp32.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const T* y, int rows_y, const int* position,
                                                                     int top_k, int n, T* out) {
  const int64_t t = blockIdx.x;
  const int col = (blockIdx.y * kCombineThreads + threadIdx.x) * 8;
  if (col >= n) return;
  float acc[8] = {};
  for (int j = 0; j < top_k; ++j) {
    const int row = position[t * top_k + j];
    if (row < 0 || row >= rows_y) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(y + static_cast<int64_t>(row) * n + col);
    const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += to_float(h[i]);
  }
  uint4 o;
  T* h = reinterpret_cast<T*>(&o);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = from_float<T>(acc[i]);
  *reinterpret_cast<uint4*>(out + t * n + col) = o;
}

cudaError_t moe_combine(const void* y, int rows_y, const int* position, int tokens, int top_k, int n, void* out,
                        DType dtype, cudaStream_t stream) {
  if (tokens == 0 || n == 0) return cudaSuccess;
  if (n % 8 || reinterpret_cast<uintptr_t>(y) % 16 || reinterpret_cast<uintptr_t>(out) % 16)
    return cudaErrorMisalignedAddress;
  const dim3 grid(tokens, (n + kCombineThreads * 8 - 1) / (kCombineThreads * 8));
  if (dtype == DType::BF16)
    moe_combine_kernel<<<grid, kCombineThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(y), rows_y, position,
                                                              top_k, n, static_cast<__nv_bfloat16*>(out));
  else if (dtype == DType::F16)
    moe_combine_kernel<<<grid, kCombineThreads, 0, stream>>>(static_cast<const __half*>(y), rows_y, position, top_k,
                                                              n, static_cast<__half*>(out));
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace kbit
