// Fused GEMM instantiations for k = 4: mma.sync MB in {1, 2, 4}, wgmma MB in {8, 16}, x {fp16, bf16} (gemm.cuh); the
// clustered kernels' occupancy query (kbit.h: gemm_clusters_at_once).
#include "gemm.cuh"

namespace kbit {
KBIT_INSTANTIATE_GEMM(4)

// Clusters of `ctas` CTAs (1..kMaxClusterCtas) of gemm.cuh's clustered kernels the current device runs at once (0: none,
// or not sm_90+). Their shared memory holds one CTA per SM, so the GPCs' sizes decide, alike for every configuration:
// the planner offers a tile cut in clusters only where all its clusters fit at once (a second wave doubles the time).
int gemm_clusters_at_once(int ctas) {
  using Cfg = GemmConfig<4, 1, 0, 0, 1, false, false, true>;
  int smem_bytes = 0;
  if (setup_once_per_device<gemm_dynamic_smem<Cfg, __half>>(smem_bytes) != cudaSuccess) return 0;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = smem_bytes;
  return clusters_at_once<gemm_kernel<Cfg, __half>>(ctas, 1, config);
}
}  // namespace kbit
