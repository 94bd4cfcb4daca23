// The grouped GEMM's configurations (moe.h): gemm.cuh's kernel with GemmConfig's G set, instantiated per bit width
// in moe_gemm_k{2,3,4,5}.cu. Passes of 8, 16 or 32 rows take mma.sync; of 128 rows, wgmma (sm_90a) with 256-row
// tiles (128 at BITS = 5, which has no room for two): the rows_per_pass values kbit/moe.py's policy picks.
#pragma once

#include "gemm.cuh"

namespace kbit {

// Calls f(GemmConfig<BITS, mb, wgmma_tiles, G>{}) if the grouped GEMM has that configuration; returns whether it has.
template <int BITS, int G, typename F>
bool with_grouped_config(int mb, int wgmma_tiles, F&& f) {
  switch (gemm_config_key(mb, wgmma_tiles)) {
    case gemm_config_key(1, 0): f(GemmConfig<BITS, 1, 0, G>{}); return true;
    case gemm_config_key(2, 0): f(GemmConfig<BITS, 2, 0, G>{}); return true;
    case gemm_config_key(4, 0): f(GemmConfig<BITS, 4, 0, G>{}); return true;
    case gemm_config_key(16, 1):
      if constexpr (BITS == 5) {
        f(GemmConfig<BITS, 16, 1, G>{});
        return true;
      }
      return false;
    case gemm_config_key(16, 2):
      if constexpr (BITS != 5) {
        f(GemmConfig<BITS, 16, 2, G>{});
        return true;
      }
      return false;
    default: return false;
  }
}

// Row tiles per warp of the grouped GEMM's wgmma configuration at BITS bits (with_grouped_config).
constexpr int grouped_wgmma_tiles(int k) { return k == 5 ? 1 : 2; }

template <int BITS, int G, typename T>
cudaError_t launch_grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  with_grouped_config<BITS, G>(p.mb, p.wgmma_tiles, [&](auto cfg) { err = launch_gemm<decltype(cfg), T>(p, stream); });
  return err;
}

template <int BITS>
cudaError_t grouped_gemm_for_bits(const GroupedGemmParams& p, cudaStream_t stream);

#define KBIT_INSTANTIATE_GROUPED_GEMM(BITS)                                                                        \
  template <>                                                                                                   \
  cudaError_t grouped_gemm_for_bits<BITS>(const GroupedGemmParams& p, cudaStream_t stream) {                       \
    constexpr int kStore = static_cast<int>(GroupedEpilogue::Store);                                            \
    constexpr int kSiluGate = static_cast<int>(GroupedEpilogue::SiluGate);                                      \
    const bool silu = p.epilogue == GroupedEpilogue::SiluGate;                                                  \
    if (p.dtype == DType::BF16)                                                                                 \
      return silu ? launch_grouped_gemm<BITS, kSiluGate, __nv_bfloat16>(p, stream)                                 \
                  : launch_grouped_gemm<BITS, kStore, __nv_bfloat16>(p, stream);                                   \
    return silu ? launch_grouped_gemm<BITS, kSiluGate, __half>(p, stream) : launch_grouped_gemm<BITS, kStore, __half>(p, stream); \
  }

}  // namespace kbit
