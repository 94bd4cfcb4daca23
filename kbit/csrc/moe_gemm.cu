// Host side of the grouped GEMM (moe.h): its plan, its parameters, dispatch on the bit width.
#include <algorithm>

#include "moe_gemm.cuh"

namespace kbit {

GemmPlan grouped_gemm_plan(int rows_per_pass, int k, int num_sms, int grid_override) {
  GemmPlan plan{};
  int smem_limit = 0, dev = 0, major = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  }
  plan.mb = rows_per_pass / 8;
  plan.wgmma_tiles = plan.mb == 16 ? grouped_wgmma_tiles(k) : 0;
  plan.k_split = 1;
  plan.tile_rows = gemm_tile_rows(k, plan.mb, plan.wgmma_tiles, plan.k_split);
  plan.smem_bytes = gemm_smem_bytes(k, plan.mb, plan.wgmma_tiles);
  plan.smem_limit = smem_limit;
  plan.cc_major = major;
  plan.built = plan.wgmma_tiles ? major == 9 : major == 0 || major >= 9 || gemm_on_sm80(k, plan.mb, 0);
  // Persistent: one CTA per SM (finish_tile's reducers wait for the CTAs after them, so all must be resident);
  // the steps are cut among them on the device, once the routing kernel has counted the passes.
  plan.grid = std::max(1, grid_override > 0 ? std::min(grid_override, num_sms) : num_sms);
  plan.cut_group = plan.grid;
  plan.cut_unit = 1;
  plan.partial_floats = static_cast<int64_t>(plan.grid) * kGemmWarps * gemm_row_tiles(k, plan.mb, plan.wgmma_tiles, 1) *
                        plan.mb * 32 * 4;  // GemmConfig::kPartialFloats per CTA: any CTA may share a tile
  return plan;
}

void grouped_gemm_fill_params(GroupedGemmParams& p, const GemmPlan& plan, int N, int K_w) {
  gemm_fill_params(p, plan, N, K_w);
  p.steps_per_cta = p.extra_steps = 0;  // cut on the device (stream_k_cut)
  p.expert_tiles16 = static_cast<int>(layout_tiles16(N));
}

cudaError_t grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream) {
  if (p.M == 0 || p.max_passes == 0) return cudaSuccess;
  if (p.K_x % kXColumnAlign || p.lda % kXColumnAlign || reinterpret_cast<uintptr_t>(p.x) % 16) {
    return cudaErrorMisalignedAddress;
  }
  return with_bits(p.k, cudaErrorInvalidValue,
                   [&](auto bits) { return grouped_gemm_for_bits<decltype(bits)::value>(p, stream); });
}

}  // namespace kbit
